"""Random programs under offload at random budgets: bitwise equal to the plain run over a warmup
and two replays, or, when autograd rejects the program, the same error and nothing held."""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from hyperpar.offload import OffloadConfig, OffloadSession
from tests.reliability.bitwise import same_bits
from tests.reliability.random_programs import B, D, Instr, RandomProgram, programs

MIB = 1 << 20
BUDGETS = st.sampled_from([0, 96, 512, 2048, 8192, 1 << 30])  # bytes; a [B, D] float32 is 128
STEPS = 3  # warmup and two replays


def _step(model: RandomProgram, x: torch.Tensor, seed: int,
          session: OffloadSession | None) -> tuple[torch.Tensor | None, BaseException | None]:
    torch.manual_seed(seed)  # dropout: the same stream in both runs
    try:
        if session is None:
            loss = model(x)
            loss.backward()
        else:
            with session:
                loss = model(x)
                loss.backward()
    except RuntimeError as exc:
        return None, exc
    return loss.detach(), None


def check_program(program: list[Instr], budget: int, planner: str = "greedy",
                  batches: tuple[int, ...] = (B,) * STEPS, accumulate: tuple[bool, ...] = ()) -> None:
    """With the default same-shaped batches every replay must match the trace (no divergence);
    other ``batches`` force re-traces. ``accumulate[i]`` keeps the gradients of step i (no
    zero_grad), so the next backward accumulates into existing ``.grad`` tensors: a different
    op sequence (``add_`` instead of ``detach``), hence also a re-trace."""
    fixed = len(set(batches)) == 1 and not any(accumulate[:len(batches) - 1])
    torch.manual_seed(0)
    plain = RandomProgram(program)
    off = copy.deepcopy(plain)
    session = OffloadSession(OffloadConfig(max_resident_activation_mb=budget / MIB, planner=planner,
                                           on_divergence="raise" if fixed else "retrace"))
    gen = torch.Generator().manual_seed(1)
    for step, rows in enumerate(batches):
        where = f"step {step} (batches {batches}) at budget {budget} B"
        x = torch.randn(rows, D, generator=gen)
        loss_a, err_a = _step(plain, x.clone(), 100 + step, None)
        loss_b, err_b = _step(off, x.clone(), 100 + step, session)
        assert session.tracked_storages() == 0, where
        if err_a is not None or err_b is not None:
            assert err_a is not None and err_b is not None, f"{where}: plain {err_a!r}, offload {err_b!r}"
            # the same kind of error; the node named may differ inside an opaque region
            assert type(err_a) is type(err_b), f"{where}: plain {err_a!r}, offload {err_b!r}"
            assert str(err_a).split(":")[0] == str(err_b).split(":")[0], f"{where}: {err_a} / {err_b}"
            assert session.held_bytes() == 0, where
            return
        assert session.last_report is not None
        if fixed:
            assert session.last_report.phase == ("warmup" if step == 0 else "replay"), where
            assert session.last_report.diverged_at is None, where
        assert same_bits(loss_a, loss_b), f"{where}: loss {loss_a} != {loss_b}"
        for (name, pa), pb in zip(plain.named_parameters(), off.parameters(), strict=True):
            assert same_bits(pa.grad, pb.grad), f"{where}: grad of {name}"
        with torch.no_grad():
            for pa, pb in zip(plain.parameters(), off.parameters(), strict=True):
                if pa.grad is not None:
                    pa.sub_(0.05 * pa.grad)
                    pb.sub_(0.05 * pb.grad)
        if step < len(accumulate) and accumulate[step]:
            continue
        plain.zero_grad(set_to_none=True)
        off.zero_grad(set_to_none=True)


MAX_EXAMPLES = 160


@settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=True, database=None)
@given(program=programs, budget=BUDGETS, planner=st.sampled_from(["greedy", "timed"]))
@example(program=[Instr("inplace_nograd", 0, 1, 0, 0), Instr("linear", 2, 0, 0, 1)], budget=0,
         planner="greedy")
# found while writing this file: a view of an opaque region's output written in place; autograd
# names a different node in the two runs (the region's graph is its own), so only the kind of
# error is compared
@example(program=[Instr("opaque", 0, 1, 0, 0), Instr("view_t", 2, 0, 0, 0),
                  Instr("inplace_any", 4, 2, 0, 1)], budget=0, planner="greedy")
@example(program=[Instr("opaque", 0, 1, 0, 0), Instr("inplace_any", 3, 0, 0, 1)], budget=0, planner="timed")
def test_random_program_is_bitwise_equal_at_random_budget(program: list[Instr], budget: int,
                                                          planner: str) -> None:
    torch.set_num_threads(1)
    check_program(program, budget, planner)


@pytest.mark.parametrize("budget", [0, 1 << 30])
def test_opaque_input_shared_outside_the_region(budget: int) -> None:
    """Found by the fuzz test: ``v`` feeds both the region and the loss. A reentrant region
    summed its gradient in another order (``bias.grad`` differed in the last bit); the
    non-reentrant region leaves the order to the one backward pass, as without it."""
    check_program([Instr("opaque_shared", 0, 1, 0, 0)], budget)


@settings(max_examples=60, deadline=None, derandomize=True, database=None)
@given(program=programs, budget=BUDGETS, batches=st.lists(st.sampled_from([2, 4, 5]), min_size=3, max_size=5),
       accumulate=st.lists(st.booleans(), min_size=5, max_size=5))
def test_changing_batches_and_accumulated_grads_stay_bitwise_equal(program: list[Instr], budget: int,
                                                                   batches: list[int],
                                                                   accumulate: list[bool]) -> None:
    """Re-traces on a changed batch (``on_divergence="retrace"``) and gradients that accumulate
    into ``.grad`` over several steps."""
    torch.set_num_threads(1)
    check_program(program, budget, "greedy", tuple(batches), tuple(accumulate))
