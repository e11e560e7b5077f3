"""Run the same training steps with and without offload and demand bitwise equality.

A case gives a model factory and a per-step input factory; the step is forward to a
scalar loss, backward, then a plain SGD update outside the session (so each replay sees
new values). Loss, every gradient, every parameter and every buffer must be equal
(``torch.equal``) after each step, at budgets of 100 %, 50 %, 20 % and 0 of the peak
measured by a first session at a huge budget.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hyperpar.offload import OffloadConfig, OffloadSession, StepReport

MIB = 1 << 20
FRACTIONS = (1.0, 0.5, 0.2, 0.0)


@dataclass
class Case:
    name: str
    build: Callable[[], nn.Module]
    inputs: Callable[[int], tuple[Any, ...]]  # step index -> forward args
    loss: Callable[[nn.Module, tuple[Any, ...]], torch.Tensor] | None = None  # default: model(*args)


def _loss(case: Case, model: nn.Module, args: tuple[Any, ...]) -> torch.Tensor:
    if case.loss is not None:
        return case.loss(model, args)
    out = model(*args)
    return out.float().sum() if out.dim() else out


def _step(case: Case, model: nn.Module, step: int, session: OffloadSession | None) -> torch.Tensor:
    args = case.inputs(step)
    torch.manual_seed(1234 + step)  # dropout and friends: the same stream in both runs
    if session is None:
        loss = _loss(case, model, args)
        loss.backward()
    else:
        with session:
            loss = _loss(case, model, args)
            loss.backward()
    return loss.detach()


def _update(model: nn.Module) -> None:
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p.sub_(0.01 * p.grad)


def _assert_same(plain: nn.Module, off: nn.Module, loss_a: torch.Tensor, loss_b: torch.Tensor,
                 where: str) -> None:
    assert torch.equal(loss_a, loss_b), f"{where}: loss {loss_a.item()} != {loss_b.item()}"
    for (name, pa), (_, pb) in zip(plain.named_parameters(), off.named_parameters(), strict=True):
        assert (pa.grad is None) == (pb.grad is None), f"{where}: grad presence of {name}"
        if pa.grad is not None:
            assert torch.equal(pa.grad, pb.grad), f"{where}: grad of {name} differs"
        assert torch.equal(pa, pb), f"{where}: parameter {name} differs"
    for (name, ba), (_, bb) in zip(plain.named_buffers(), off.named_buffers(), strict=True):
        assert torch.equal(ba, bb), f"{where}: buffer {name} differs"


def measure_peak(case: Case) -> int:
    torch.manual_seed(0)
    model = case.build()
    session = OffloadSession(OffloadConfig(max_resident_activation_mb=1e9))
    _step(case, model, 0, session)
    assert session.last_report is not None
    return session.last_report.peak_resident_bytes


def run_equality(case: Case, fractions: tuple[float, ...] = FRACTIONS, replays: int = 3,
                 **config: Any) -> dict[float, list[StepReport]]:
    """Returns the reports of every step, per budget fraction."""
    peak = measure_peak(case)
    assert peak > 0, f"{case.name}: no activation was tracked"
    reports: dict[float, list[StepReport]] = {}
    for frac in fractions:
        torch.manual_seed(0)
        plain = case.build()
        off = copy.deepcopy(plain)
        session = OffloadSession(OffloadConfig(max_resident_activation_mb=peak * frac / MIB, **config))
        reports[frac] = []
        for step in range(1 + replays):
            where = f"{case.name} at {frac:.0%} of {peak} bytes, step {step}"
            loss_a = _step(case, plain, step, None)
            loss_b = _step(case, off, step, session)
            assert session.last_report is not None
            reports[frac].append(session.last_report)
            assert session.last_report.phase == ("warmup" if step == 0 else "replay"), where
            assert session.last_report.diverged_at is None, where
            # The plan brings back everything before it is read: no synchronous page-in at replay.
            assert step == 0 or session.last_report.demand_faults == 0, (where, session.last_report)
            assert session.tracked_storages() == 0, where
            _assert_same(plain, off, loss_a, loss_b, where)
            _update(plain)
            _update(off)
            plain.zero_grad(set_to_none=True)
            off.zero_grad(set_to_none=True)
            if frac == 0.0 and step > 0:  # planned for the floor: it moves where that is below the peak
                floor = session.last_report.min_feasible_budget_bytes
                assert session.trace is not None and floor is not None
                peak_now = session.trace.peak_bytes_without_offload()
                assert session.last_report.bytes_d2h > 0 or floor >= peak_now, (where, session.last_report)
    if 0.0 in reports:  # warmup evicts online
        assert reports[0.0][0].bytes_d2h > 0, f"{case.name}: nothing was offloaded at budget 0"
    return reports
