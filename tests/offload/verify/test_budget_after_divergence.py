"""Issue 11, item 2: a step that departs from its plan still keeps the budget, and its report
carries the true peak, overshoot and faults. Two departures: another structure (an extra op
in the middle: the step diverges and finishes on warmup's online path) and another batch size
(the same structure: it replays the plan made for the old size, evicting beyond it where it
holds more). A warmup of the same step at the same budget is the yardstick: its peak is
measured over every tracked storage."""

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
    def __init__(self, extra: bool = False) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(WIDTH, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(),
                                 nn.Linear(64, WIDTH))
        self.extra = extra  # one more op in the middle: another structure

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.net[:3](x)
        if self.extra:
            h = h * 1.5
        return self.net[3:](h).square().sum()


def _with_extra() -> nn.Module:
    return _Mlp(extra=True)


def _batch(rows: int, seed: int) -> torch.Tensor:
    return torch.randn(rows, WIDTH, generator=torch.Generator().manual_seed(seed))


def _warmup_report(rows: int, budget: float, extra: bool) -> StepReport:
    """The same step traced from scratch at the same budget: its peak is measured."""
    session = session_at(budget)
    torch.manual_seed(0)
    train_step(_Mlp(extra), (_batch(rows, 99),), session)
    assert session.last_report is not None and session.last_report.phase == "warmup"
    return session.last_report


@pytest.mark.parametrize("change", ["structure", "size"])
@pytest.mark.parametrize("frac", [0.0, 0.25, 0.5])
@pytest.mark.parametrize(("rows", "new_rows"), [(8, 32), (32, 8)])
def test_a_departing_step_keeps_the_budget_and_reports_its_peak(rows: int, new_rows: int, frac: float,
                                                                 change: str) -> None:
    """On main the step after a batch change ran without any eviction (the no-offload peak)
    and reported peak 0, no overshoot."""
    torch.set_num_threads(1)
    extra = change == "structure"
    budget = measured_peak(lambda: _Mlp(extra), (_batch(new_rows, 0),)) * frac
    run = Lockstep(_mlp, session_at(budget))
    run.step(_batch(rows, 1))
    assert run.step(_batch(rows, 2)).diverged_at is None
    run.plain.extra = run.off.extra = extra  # type: ignore[assignment]
    departed = run.step(_batch(new_rows, 3))
    assert (departed.diverged_at is not None) == extra, departed
    warm = _warmup_report(new_rows, budget, extra)
    where = f"{rows} -> {new_rows} rows, {change}, at budget {budget:.0f} B: {departed!r}, warmup {warm!r}"
    assert departed.peak_resident_bytes > 0, f"peak 0 reported for a step that held bytes; {where}"
    if warm.bytes_d2h:
        assert departed.bytes_d2h > 0, f"nothing was evicted under a budget below the peak; {where}"
    assert departed.budget_bytes == int(budget), where
    if warm.overshoot_bytes == 0:  # feasible: the departing step must keep the budget too
        assert departed.peak_resident_bytes <= budget * SLACK, where
    else:  # infeasible: the overshoot is reported, and it is the true one
        assert departed.overshoot_bytes > 0, where
        assert departed.overshoot_bytes == departed.peak_resident_bytes - departed.budget_bytes, where
        # no worse than warmup's online eviction or the plan's floor, whichever is higher
        worst = max(warm.peak_resident_bytes, departed.min_feasible_budget_bytes or 0)
        assert departed.peak_resident_bytes <= worst * SLACK, where
        assert departed.overshoot_op is not None, where
    # and the next step of the new kind follows a plan made for it
    again = run.step(_batch(new_rows, 4))
    assert again.diverged_at is None and again.demand_faults == 0, again
    if warm.overshoot_bytes == 0:
        assert again.peak_resident_bytes <= budget * SLACK, again


def test_raise_once_per_new_structure_then_learn_it() -> None:
    """``on_divergence="raise"`` raises on the first step of a new structure only; the next
    step is traced, and from then on both structures replay (a step switches to its known
    plan). On main every later step of the new kind raised again. Batch sizes change too:
    those are the same structure and never raise."""
    torch.set_num_threads(1)
    run = Lockstep(_mlp, session_at(0, on_divergence="raise"))
    kinds = [(8, False), (8, False), (32, True), (32, True), (8, False), (16, True), (8, False),
             (32, True), (4, False), (32, True)]
    raised: list[int] = []
    for step, (n, extra) in enumerate(kinds):
        run.plain.extra = run.off.extra = extra  # type: ignore[assignment]
        x = _batch(n, step)
        try:
            run.step(x, where=f"kinds {kinds}")
        except OffloadDivergenceError:
            raised.append(step)
            # the step never reached backward: the plain model (already stepped) drops it too
            assert all(p.grad is None for p in run.off.parameters()), f"step {step}: grads after the raise"
            run.plain.zero_grad(set_to_none=True)
            run.reports.append(StepReport("raised", 0, 0, 0))
    assert raised == [2], f"raised at steps {raised} of {kinds} (only the new structure's first step may)"
    phases = [(r.phase, r.diverged_at) for r in run.reports]
    assert phases[3][0] == "warmup" and phases[4:] == [("replay", None)] * 6, phases
