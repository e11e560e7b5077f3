"""A custom planner (``OffloadConfig(planner=obj)``) is user code: its schedule may be nonsense.
The runtime only releases a storage that has a current host copy and pages in whatever an op
needs, so replay must still give bitwise-equal results, and hold nothing afterwards."""

from __future__ import annotations

import copy
import random

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hyperpar.offload import OffloadConfig, OffloadSession
from hyperpar.offload.ir import ActivationTrace, ResidencyAction, ResidencySchedule
from hyperpar.offload.ir import ResidencyActionType as Act
from hyperpar.offload.planning import get_planner
from tests.reliability.bitwise import same_bits
from tests.reliability.random_programs import B, D, Instr, RandomProgram

PROGRAM = [Instr("linear", 0, 0, 0, 0), Instr("unary", 2, 0, 0, 1), Instr("inplace_nograd", 3, 1, 0, 0),
           Instr("linear", 4, 0, 0, 1), Instr("max_tuple", 6, 3, 0, 0), Instr("opaque", 7, 2, 0, 0),
           Instr("checkpoint", 8, 9, 0, 2), Instr("split_cat", 10, 0, 0, 0)]


class RandomPlanner:
    """Scatters random actions over the ops, or scrambles a real plan."""

    def __init__(self, seed: int, mode: str) -> None:
        self.rng = random.Random(seed)
        self.mode = mode

    def build(self, trace: ActivationTrace) -> ResidencySchedule:
        n, sids, rng = trace.num_ops, sorted(trace.storage_sizes), self.rng
        if self.mode == "scramble":
            schedule = get_planner("greedy").build(trace)
            actions = [a for _, _, a in schedule.actions()]
            rng.shuffle(actions)
        else:
            count = rng.randint(0, 4 * n)
            actions = [ResidencyAction(rng.choice(list(Act)), rng.choice(sids)) for _ in range(count)]
        schedule = ResidencySchedule.empty(n, planner=f"random-{self.mode}")
        for action in actions:
            (schedule.pre if rng.random() < 0.5 else schedule.post)[rng.randrange(n)].append(action)
        return schedule


@settings(max_examples=80, deadline=None, derandomize=True, database=None)
@given(seed=st.integers(0, 2**32 - 1), mode=st.sampled_from(["random", "scramble"]),
       budget=st.sampled_from([0, 1024, 1 << 30]), engine=st.sampled_from(["thread", "sync"]))
def test_a_nonsense_schedule_is_never_silently_wrong(seed: int, mode: str, budget: int, engine: str) -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    plain = RandomProgram(PROGRAM)
    off = copy.deepcopy(plain)
    session = OffloadSession(OffloadConfig(max_resident_activation_mb=budget / (1 << 20),
                                           planner=RandomPlanner(seed, mode), copy_engine=engine))
    gen = torch.Generator().manual_seed(seed)
    for step in range(3):
        x = torch.randn(B, D, generator=gen)
        torch.manual_seed(step)
        loss_a = plain(x)
        loss_a.backward()
        torch.manual_seed(step)
        with session:
            loss_b = off(x)
            loss_b.backward()
        assert same_bits(loss_a.detach(), loss_b.detach()), f"step {step}: loss"
        for (name, pa), pb in zip(plain.named_parameters(), off.parameters(), strict=True):
            assert same_bits(pa.grad, pb.grad), f"step {step}: grad of {name}"
        plain.zero_grad(set_to_none=True)
        off.zero_grad(set_to_none=True)
        assert session.tracked_storages() == 0
        assert session.last_report is not None and session.last_report.diverged_at is None
