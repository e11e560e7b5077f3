"""Issue 11, item 2: a step that departs from its plan (here a new batch size, which diverges
within the first ops) still keeps the budget by warmup's online eviction and demand paging,
and its report carries the true peak, overshoot and faults. A warmup of the same shape at
the same budget is the yardstick: its peak is measured over every tracked storage."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hyperpar.offload import OffloadDivergenceError, StepReport
from tests.offload.verify.lockstep import Lockstep, measured_peak, session_at, train_step

WIDTH = 16
SLACK = 1.05


def _mlp() -> nn.Module:
    return _Mlp()


class _Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(WIDTH, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(),
                                 nn.Linear(64, WIDTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x).square().sum()


def _batch(rows: int, seed: int) -> torch.Tensor:
    return torch.randn(rows, WIDTH, generator=torch.Generator().manual_seed(seed))


def _warmup_report(rows: int, budget: float) -> StepReport:
    """The same step shape traced from scratch at the same budget: its peak is measured."""
    session = session_at(budget)
    torch.manual_seed(0)
    train_step(_mlp(), (_batch(rows, 99),), session)
    assert session.last_report is not None and session.last_report.phase == "warmup"
    return session.last_report


@pytest.mark.parametrize("frac", [0.0, 0.25, 0.5])
@pytest.mark.parametrize(("rows", "new_rows"), [(8, 32), (32, 8)])
def test_a_diverged_step_keeps_the_budget_and_reports_its_peak(rows: int, new_rows: int, frac: float) -> None:
    """On main the step after a batch change ran without any eviction (the no-offload peak)
    and reported peak 0, no overshoot."""
    torch.set_num_threads(1)
    budget = measured_peak(_mlp, (_batch(new_rows, 0),)) * frac
    run = Lockstep(_mlp, session_at(budget))
    run.step(_batch(rows, 1))
    assert run.step(_batch(rows, 2)).diverged_at is None
    diverged = run.step(_batch(new_rows, 3))
    assert diverged.diverged_at is not None, diverged
    warm = _warmup_report(new_rows, budget)
    where = f"{rows} -> {new_rows} rows at budget {budget:.0f} B: diverged {diverged!r}, warmup {warm!r}"
    assert diverged.peak_resident_bytes > 0, f"peak 0 reported for a step that held bytes; {where}"
    if warm.bytes_d2h:
        assert diverged.bytes_d2h > 0, f"nothing was evicted under a budget below the peak; {where}"
    assert diverged.budget_bytes == int(budget), where
    if warm.overshoot_bytes == 0:  # feasible: the diverged step must keep the budget too
        assert diverged.peak_resident_bytes <= budget * SLACK, where
        assert diverged.overshoot_bytes == 0, where
    else:  # infeasible: the overshoot is reported, and it is the true one
        assert diverged.overshoot_bytes > 0, where
        assert diverged.overshoot_bytes == diverged.peak_resident_bytes - diverged.budget_bytes, where
        true_peak = warm.peak_resident_bytes
        assert true_peak / SLACK <= diverged.peak_resident_bytes <= true_peak * SLACK, where
        assert diverged.overshoot_op is not None, where
    if warm.demand_faults:
        assert diverged.demand_faults > 0, f"the diverged step's page-ins are not reported; {where}"


def test_raise_once_per_new_structure_then_learn_it() -> None:
    """``on_divergence="raise"`` raises on the first step of a new shape only; the session then
    learns that shape, and the old shape still replays. On main every later step of the new
    shape raised again."""
    torch.set_num_threads(1)
    run = Lockstep(_mlp, session_at(0, on_divergence="raise"))
    rows = [8, 8, 32, 32, 8, 32, 8, 32, 8, 32]
    raised: list[int] = []
    for step, n in enumerate(rows):
        x = _batch(n, step)
        try:
            run.step(x, where=f"rows {rows}")
        except OffloadDivergenceError:
            raised.append(step)
            # the step never reached backward: the plain model (already stepped) drops it too
            assert all(p.grad is None for p in run.off.parameters()), f"step {step}: grads after the raise"
            run.plain.zero_grad(set_to_none=True)
            run.reports.append(StepReport("raised", 0, 0, 0))
    assert raised == [2], f"raised at steps {raised} of {rows} (only the new shape's first step may raise)"
    phases = [(r.phase, r.diverged_at) for r in run.reports]
    assert phases[-2:] == [("replay", None)] * 2, f"8/32 alternation did not settle: {phases}"
