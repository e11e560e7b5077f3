"""Budgets a user can act on: the floor in every report, said once when the budget is below
it, and a budget given as a fraction of the measured peak."""

from __future__ import annotations

import itertools
import logging
import math
from dataclasses import replace

import pytest
import torch

from hyperpar.models import GPT, GPTConfig, random_batch
from hyperpar.offload import OffloadConfig, OffloadSession, StepReport
from hyperpar.offload.ir import ActivationTrace
from hyperpar.offload.planning import simulate
from hyperpar.offload.planning.deficit_warnings import deficit_warnings_muted
from hyperpar.offload.planning.floor import budget_floor
from hyperpar.offload.planning.sweep import plan_point, with_budget

BELOW = "below the feasible floor"


@pytest.fixture(autouse=True)
def _one_thread() -> object:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # bitwise comparisons need a repeatable plain run
    yield
    torch.set_num_threads(threads)


def _model_and_batch() -> tuple[GPT, tuple[torch.Tensor, torch.Tensor]]:
    cfg = GPTConfig.tiny()
    torch.manual_seed(0)
    return GPT(cfg), random_batch(cfg, 2, torch.Generator().manual_seed(1), torch.device("cpu"))


def _steps(session: OffloadSession | None, n: int) -> tuple[list[StepReport], list[torch.Tensor]]:
    model, (x, y) = _model_and_batch()
    reports = []
    for _ in range(n):
        model.zero_grad(set_to_none=True)
        if session is None:
            model.loss(x, y).backward()
        else:
            with session:
                model.loss(x, y).backward()
            assert session.last_report is not None
            reports.append(session.last_report)
    return reports, [p.grad.clone() for p in model.parameters()]


def _warnings(caplog: pytest.LogCaptureFixture, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and text in r.getMessage()]


def test_below_the_floor_is_said_once_with_the_floor_in_mib(caplog: pytest.LogCaptureFixture) -> None:
    session = OffloadSession(OffloadConfig(max_resident_activation_mb=0))
    with caplog.at_level(logging.WARNING):
        reports, _ = _steps(session, 3)
    assert session.trace is not None
    floor = budget_floor(session.trace)
    said = _warnings(caplog, BELOW)
    assert len(said) == 1 and f"{floor.floor_bytes / (1 << 20):.2f} MiB" in said[0]
    assert not _warnings(caplog, "exceeds the budget")  # the planners stay quiet: it was said
    for report in reports:
        assert report.min_feasible_budget_bytes == floor.floor_bytes > 0
        assert report.unmovable_retained_bytes + report.unmovable_working_set_bytes == floor.floor_bytes
        assert "floor" in str(report)


def test_a_budget_at_the_floor_says_nothing(caplog: pytest.LogCaptureFixture) -> None:
    probe = OffloadSession(OffloadConfig(max_resident_activation_mb=0))
    with caplog.at_level(logging.ERROR):
        _steps(probe, 1)
    assert probe.trace is not None
    floor = budget_floor(probe.trace).floor_bytes
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        reports, _ = _steps(OffloadSession(OffloadConfig(max_resident_activation_mb=floor / (1 << 20))), 2)
    assert not _warnings(caplog, BELOW)
    assert reports[-1].min_feasible_budget_bytes == floor <= reports[-1].budget_bytes


def _kept_and_movable_peak(trace: ActivationTrace) -> tuple[int, int]:
    """Independently of planning: the retained storages' bytes and the others' peak."""
    lifetimes = trace.lifetimes()
    kept = sum(trace.storage_sizes[sid] for sid in trace.retained_sids if sid in lifetimes)
    alive = [0] * (trace.num_ops + 1)
    for sid, (lo, hi) in lifetimes.items():
        if sid not in trace.retained_sids:
            alive[lo] += trace.storage_sizes[sid]
            alive[hi + 1] -= trace.storage_sizes[sid]
    return kept, max(itertools.accumulate(alive[:-1]), default=0)


def test_fraction_budget_is_resolved_from_the_first_trace_and_keeps_gradients() -> None:
    session = OffloadSession(OffloadConfig(max_resident_fraction=0.75))
    reports, grads = _steps(session, 3)
    _, plain = _steps(None, 3)
    assert session.trace is not None and session.schedule is not None
    kept, movable_peak = _kept_and_movable_peak(session.trace)
    assert kept > 0  # the parameter gradients, the loss
    budget = int(0.75 * movable_peak) + kept
    assert reports[0].phase == "warmup" and reports[0].budget_bytes == OffloadConfig().budget_bytes
    assert [r.budget_bytes for r in reports[1:]] == [budget, budget]
    assert [(r.kept_bytes, r.movable_peak_bytes) for r in reports] == [(kept, movable_peak)] * 3
    assert f"movable peak {movable_peak / (1 << 20):.1f} MiB" in str(reports[-1])
    assert session.trace.memory_limit_bytes == budget
    assert reports[-1].phase == "replay" and reports[-1].bytes_d2h > 0
    assert all(r.peak_resident_bytes <= budget for r in reports[1:])
    assert all(torch.equal(a, b) for a, b in zip(grads, plain, strict=True))


@pytest.mark.usefixtures("steady_link")  # the plan's simulated bytes: on a fixed link
def test_a_fraction_holds_the_movable_bytes_at_every_op() -> None:
    """The share is of the bytes a plan can move, at every op: with parameter gradients as
    large as the activations, a budget of the whole peak (gradients counted as activations)
    would let the forward keep everything; the plan must not."""
    cfg = GPTConfig(vocab_size=512, seq_len=32, n_layer=2, n_head=2, d_model=64)
    torch.manual_seed(0)
    model = GPT(cfg)
    x, y = random_batch(cfg, 1, torch.Generator().manual_seed(1), torch.device("cpu"))
    session = OffloadSession(OffloadConfig(max_resident_fraction=0.5))
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        with session:
            model.loss(x, y).backward()
    trace, schedule = session.trace, session.schedule
    assert trace is not None and schedule is not None
    kept, movable_peak = _kept_and_movable_peak(trace)
    assert kept > movable_peak // 2  # the case this test is for
    unreserved = replace(trace, reserve_retained=False)
    resident = simulate(unreserved, schedule).resident_bytes
    retained_alive = [0] * (trace.num_ops + 1)
    for sid, (lo, _) in unreserved.lifetimes().items():
        if sid in trace.retained_sids:
            retained_alive[lo] += trace.storage_sizes[sid]
    movable = [r - k for r, k in zip(resident, itertools.accumulate(retained_alive[:-1]), strict=True)]
    assert max(movable) <= int(0.5 * movable_peak) < movable_peak
    assert session.last_report is not None and session.last_report.bytes_d2h > 0


def test_a_budget_below_the_floor_gets_the_plan_for_the_floor() -> None:
    """Not a plan chasing an unreachable budget: the plan of the floor, on the same trace."""
    below = OffloadSession(OffloadConfig(max_resident_activation_mb=0))
    low, grads = _steps(below, 2)
    trace, schedule = below.trace, below.schedule
    assert trace is not None and schedule is not None
    floor = budget_floor(trace).floor_bytes
    assert low[-1].budget_bytes == 0 < floor
    with deficit_warnings_muted():
        at_floor = plan_point(with_budget(trace, floor), "timed")[0]
        chasing = plan_point(with_budget(trace, 0), "timed")[0]
    assert (schedule.budget_bytes, schedule.predicted_peak_bytes) == (floor, at_floor.predicted_peak_bytes)
    assert simulate(trace, schedule).bytes_d2h == at_floor.bytes_d2h < chasing.bytes_d2h
    assert low[-1].bytes_d2h < chasing.bytes_d2h
    _, plain = _steps(None, 2)
    assert all(torch.equal(a, b) for a, b in zip(grads, plain, strict=True))


@pytest.mark.parametrize("value, error, text", [
    ("0.5", TypeError, "OffloadConfig.max_resident_fraction must be None or a number in (0, 1], got '0.5'"),
    (True, TypeError, "OffloadConfig.max_resident_fraction must be None or a number in (0, 1], got True"),
    (0, ValueError, "OffloadConfig.max_resident_fraction must be in (0, 1], got 0"),
    (1.5, ValueError, "OffloadConfig.max_resident_fraction must be in (0, 1], got 1.5"),
    (-0.1, ValueError, "OffloadConfig.max_resident_fraction must be in (0, 1], got -0.1"),
    (math.nan, ValueError, "OffloadConfig.max_resident_fraction must be in (0, 1], got nan"),
])
def test_bad_fraction_names_field_and_value(value: object, error: type[Exception], text: str) -> None:
    with pytest.raises(error) as exc:
        OffloadConfig(max_resident_fraction=value)  # type: ignore[arg-type]
    assert str(exc.value) == text


def test_budget_for_peak() -> None:
    assert OffloadConfig(max_resident_activation_mb=2).budget_for_peak(10**9, 5) == 2 << 20
    assert OffloadConfig(max_resident_fraction=0.5).budget_for_peak(1001) == 500
    assert OffloadConfig(max_resident_fraction=0.5).budget_for_peak(1001, 7) == 507
    assert OffloadConfig(max_resident_fraction=1).budget_for_peak(1001) == 1001


@pytest.mark.parametrize("fraction", [0.0, 0.5, 2.0])
def test_warmup_and_replay_report_the_same_quantity(fraction: float) -> None:
    """For the same step, warmup and replay measure activation bytes the same way (live
    activation bytes minus those on host): at a budget that moves nothing they report the
    same peak, and no report exceeds the peak without offload. A replay cannot go under the
    plan's floor; warmup's online eviction may (it also moves storages past their last
    access, such as gradients, which the plan keeps)."""
    probe = OffloadSession(OffloadConfig(max_resident_activation_mb=float(1 << 20)))
    _steps(probe, 1)
    assert probe.trace is not None
    peak = probe.trace.peak_bytes_without_offload()
    floor = budget_floor(probe.trace).floor_bytes
    session = OffloadSession(OffloadConfig(max_resident_activation_mb=int(peak * fraction) / (1 << 20)))
    warmup, replay = _steps(session, 2)[0]
    assert (warmup.phase, replay.phase) == ("warmup", "replay")
    for report in (warmup, replay):
        assert 0 < report.peak_resident_bytes <= peak, report
    assert replay.peak_resident_bytes >= floor * 0.98, replay
    if fraction > 1:  # nothing moves: the very same bytes
        assert warmup.bytes_d2h == replay.bytes_d2h == 0
        assert warmup.peak_resident_bytes == replay.peak_resident_bytes == peak, (warmup, replay)


def test_plan_for_a_device_plans_on_its_model_and_runs_here_bitwise() -> None:
    """``plan_for="h100"``: the planner sees the op times and link of the h100 model (its
    prediction is of that device), and the plan runs here with the same gradients."""
    from hyperpar.offload.projection import HostCosts, device_op_ms, get_device

    here = OffloadSession(OffloadConfig(max_resident_fraction=0.5))
    _, grads_here = _steps(here, 3)
    there = OffloadSession(OffloadConfig(max_resident_fraction=0.5, plan_for="h100"))
    reports, grads_there = _steps(there, 3)
    _, plain = _steps(None, 3)
    assert there.trace is not None and here.trace is not None
    device_ms = float(device_op_ms(there.trace, get_device("h100"), HostCosts().replay_us).sum())
    predicted = reports[-1].predicted_step_ms
    assert predicted is not None and device_ms * (1 - 1e-9) <= predicted < 2 * device_ms
    assert here.last_report is not None and here.last_report.predicted_step_ms != predicted
    assert reports[-1].bytes_d2h > 0 and all(r.peak_resident_bytes <= r.budget_bytes for r in reports[1:])
    assert all(torch.equal(a, b) for a, b in zip(grads_there, plain, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(grads_here, plain, strict=True))
