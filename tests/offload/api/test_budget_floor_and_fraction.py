"""Budgets a user can act on: the floor in every report, said once when the budget is below
it, and a budget given as a fraction of the measured peak."""

from __future__ import annotations

import logging
import math

import pytest
import torch

from hyperpar.models import GPT, GPTConfig, random_batch
from hyperpar.offload import OffloadConfig, OffloadSession, StepReport
from hyperpar.offload.planning.floor import budget_floor

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


def test_fraction_budget_is_resolved_from_the_first_trace_and_keeps_gradients() -> None:
    session = OffloadSession(OffloadConfig(max_resident_fraction=0.75))
    reports, grads = _steps(session, 3)
    _, plain = _steps(None, 3)
    assert session.trace is not None
    budget = int(0.75 * session.trace.peak_bytes_without_offload())
    assert reports[0].phase == "warmup" and reports[0].budget_bytes == OffloadConfig().budget_bytes
    assert [r.budget_bytes for r in reports[1:]] == [budget, budget]
    assert session.trace.memory_limit_bytes == session.schedule.budget_bytes == budget
    assert reports[-1].phase == "replay" and reports[-1].bytes_d2h > 0
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
    assert OffloadConfig(max_resident_activation_mb=2).budget_for_peak(10**9) == 2 << 20
    assert OffloadConfig(max_resident_fraction=0.5).budget_for_peak(1001) == 500
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
