"""Rank bodies: functional collectives inside a session (what torchtitan's expert parallelism
issues). Their outputs are written by the process group after the op returns, until
``wait_tensor``; on main a budget evicted them in between (SIGSEGV/SIGABRT on gloo)."""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn

from tests.offload.verify.lockstep import differences, session_at, sgd_and_zero, train_step

ROWS, WIDTH = 8, 16


class FunctionalCollectives(nn.Module):
    """Every functional collective issued first, ops that push the step over the budget in
    between, the waits (implicit on first use, or ``wait_tensor``) last."""

    def __init__(self, raw: bool) -> None:
        super().__init__()
        self.inp = nn.Linear(WIDTH, WIDTH)
        self.out = nn.Linear(WIDTH, 1)
        self.raw = raw

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        group = dist.group.WORLD
        assert group is not None
        h = torch.tanh(self.inp(x))
        world = dist.get_world_size()
        if self.raw:
            name = group.group_name
            ops = torch.ops._c10d_functional
            split = [ROWS // world] * world
            issued = [ops.all_reduce(h.detach() * 2.0, "sum", name),
                      ops.all_gather_into_tensor(h.detach() * 3.0, world, name),
                      ops.all_to_all_single(h.detach() * 4.0, split, split, name)]
        else:
            issued = [funcol.all_reduce(h.detach() * 2.0, "sum", group),
                      funcol.all_gather_tensor(h.detach() * 3.0, 0, group),
                      funcol.all_to_all_single(h.detach() * 4.0, None, None, group),
                      funcol.all_to_all_single_autograd(h * 5.0, None, None, group)]  # differentiable
        later = h
        for _ in range(6):  # a few activations: at any budget below the peak, older ones leave
            later = torch.tanh(later * 1.1)
        if self.raw:
            issued = [ops.wait_tensor(t) for t in issued]
        reduced, gathered, exchanged = issued[0], issued[1], issued[2]
        mixed = later + reduced + gathered.view(world, ROWS, WIDTH).sum(0) + exchanged
        if not self.raw:
            mixed = mixed + issued[3]
        return self.out(mixed).square().sum()


def _one_combination(rank: int, raw: bool, budget_frac: float, steps: int = 3) -> dict[str, Any]:
    """Per step: loss and gradients bitwise equal to the same program without a session."""
    torch.manual_seed(0)
    plain = FunctionalCollectives(raw)
    off = copy.deepcopy(plain)
    gen = torch.Generator().manual_seed(rank)
    xs = [torch.randn(ROWS, WIDTH, generator=gen) for _ in range(steps + 1)]
    probe = session_at(1 << 50)
    train_step(copy.deepcopy(plain), (xs[-1],), probe)
    assert probe.last_report is not None
    session = session_at(probe.last_report.peak_resident_bytes * budget_frac, copy_engine="thread")
    differs: list[str] = []
    for step in range(steps):
        loss_a = train_step(plain, (xs[step],), None)
        loss_b = train_step(off, (xs[step],), session)
        differs += [f"step {step}: {d}" for d in differences(plain, off, loss_a, loss_b)]
        sgd_and_zero(plain, off)
    assert session.last_report is not None
    return {"differs": differs, "phase": session.last_report.phase, "moved": session.last_report.bytes_d2h}


def functional_collectives_match_plain(rank: int, world: int) -> dict[str, dict[str, Any]]:
    """Both APIs at budgets 0 and 50 % of the peak; an exception is kept per combination
    (the progress lines name the combination a crash happened in)."""
    out: dict[str, dict[str, Any]] = {}
    for raw in (False, True):
        for frac in (0.0, 0.5):
            combo = f"{'_c10d_functional' if raw else 'funcol'} at budget {frac}"
            print(f"rank {rank}: {combo}", flush=True)
            try:
                out[combo] = {"error": None, **_one_combination(rank, raw, frac)}
            except Exception as exc:
                out[combo] = {"error": f"{type(exc).__name__}: {exc}"}
    return out
