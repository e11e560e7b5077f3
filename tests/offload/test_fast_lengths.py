"""Steps of several lengths on the fast path: a plan whose saved tensors cover a shorter
step's (``covers``) runs it without the dispatch mode, bitwise and within the budget; a
longer step than any plan learned falls back at its first saved tensor and, once checked,
teaches its plan the longer length; whatever departs inside a covered step (aliasing, a
storage larger than the plan's) is still caught."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from hyperpar.offload import OffloadConfig, OffloadSession
from hyperpar.offload.capture.fast.fast_moves import MovingStep
from hyperpar.offload.capture.fast.fast_schedule import MoveSchedule
from hyperpar.offload.capture.fast.saved_tensor_guard import covers
from hyperpar.offload.runtime import HostPool, SyncCopyEngine
from tests.offload.test_fast_moves import _budget, _settled
from tests.offload.test_fast_replay import _aliasing, _plain_body, _run, _steps, _weights

# the planner's link fixed: these tests assert which path a plan takes (see conftest)
pytestmark = pytest.mark.usefixtures("steady_link")


def _budget_at(length: int, fraction: float) -> int:
    """``fraction`` of a ``length`` step's activation peak, or just above its floor."""
    probe = OffloadSession(OffloadConfig(max_resident_activation_mb=1e6))
    _run(probe, _plain_body, _weights(), 0, length)
    report = probe.last_report
    assert report is not None and report.min_feasible_budget_bytes is not None
    return max(int(report.peak_resident_bytes * fraction), int(report.min_feasible_budget_bytes * 1.02))


def test_covers_wants_the_same_aliasing_dtype_version_and_rank_and_no_larger_size() -> None:
    planned = (torch.Size([64, 32]), torch.float32, 3, 64, 1)
    assert covers(planned, (torch.Size([48, 32]), torch.float32, 3, 0, 1))
    assert covers(planned, planned)
    assert not covers(planned, (torch.Size([65, 32]), torch.float32, 3, 0, 1))  # larger
    assert not covers(planned, (torch.Size([48, 32]), torch.float32, 3, 96, 1))  # further in
    assert not covers(planned, (torch.Size([48, 32]), torch.float32, 2, 0, 1))  # another storage
    assert not covers(planned, (torch.Size([48, 32]), torch.float64, 3, 0, 1))
    assert not covers(planned, (torch.Size([48, 32]), torch.float32, 3, 0, 2))  # written once more
    assert not covers(planned, (torch.Size([48, 32, 1]), torch.float32, 3, 0, 1))


def test_shorter_steps_run_fast_on_the_plan_that_learned_a_longer_one() -> None:
    """Lengths 32..96 after the plan learned 96: every shorter step is fast (before, each
    length had to be learned on its own, and lengths that kept changing stayed checked)."""
    budget = _budget_at(96, 0.5)
    lengths = [96] * 8 + [64, 80, 48, 96, 32, 72, 56, 88]
    session, reports = _steps(_plain_body, budget, lengths)
    paths = [r.replay_path for r in reports]
    first = _settled(paths[:8])
    assert paths[8:] == ["fast"] * 8, paths
    assert all(r.bytes_d2h > 0 for r in reports[first:]), reports
    structure = next(iter(session._structures.values()))
    assert structure.departures == 0 and structure.size_misses == 0


def test_a_longer_step_falls_back_once_then_teaches_its_plan() -> None:
    # (at lower budgets the checked step grown past the 48 plan may hold up to replay's fixed
    # 64 KiB slack over the budget before it evicts beyond its plan: over 5 % of this tiny step's)
    budget = _budget_at(64, 1.0)
    lengths = [48] * 8 + [64] + [64] * 5 + [48, 56]
    session, reports = _steps(_plain_body, budget, lengths)
    paths = [r.replay_path for r in reports]
    _settled(paths[:8])
    assert paths[8] == "fallback" and reports[8].departed_at_saved == 0, paths
    assert paths[-3:] == ["fast"] * 3, paths  # 64 learned: 64, 48 and 56 go fast
    structure = next(iter(session._structures.values()))
    assert structure.departures == 0


def test_after_learning_steps_that_missed_the_length_covered_lengths_stay_fast() -> None:
    """Four checked 48 steps after a 64 fallback do not teach 64: at the next 64 fallback
    the 48 steps stay fast (before, each such fallback made every length checked for four
    steps, which random lengths paid at each of their longest few); the one after begins
    learning steps again, and 64 is learned once a 64 step comes among them."""
    budget = _budget_at(64, 1.0)
    lengths = [48] * 8 + [64] + [48] * 5 + [64, 48, 48] + [64, 64, 64, 48, 64, 48]
    session, reports = _steps(_plain_body, budget, lengths)
    paths = [r.replay_path for r in reports]
    _settled(paths[:8])
    assert paths[8:14] == ["fallback"] + ["checked"] * 4 + ["fast"], paths  # learning steps: no 64
    assert paths[14:17] == ["fallback", "fast", "fast"], paths  # passed: 48 stays fast
    assert reports[14].departed_at_saved == 0, reports[14]
    assert paths[17:20] == ["fallback", "checked", "checked"], paths  # learning again: 64 planned, learned
    assert paths[20:] == ["fast"] * 3, paths
    structure = next(iter(session._structures.values()))
    assert structure.departures == 0, structure


def test_a_covered_step_that_aliases_otherwise_departs() -> None:
    def body(x: torch.Tensor, ws: list[torch.Tensor], step: int) -> torch.Tensor:
        return _aliasing(x, ws, 0 if x.shape[0] == 64 else 3)

    _, reports = _steps(body, int(_budget(body, 0.9) * 1.2), [64] * 5 + [48])
    paths = [r.replay_path for r in reports]
    assert paths[4] == "fast" and paths[5] == "fallback", paths
    assert reports[5].departed_at_saved is not None and reports[5].departed_at_saved > 0


def test_a_moved_storage_larger_than_the_plans_leaves_the_plan() -> None:
    """Saved tensors can fit the plan's while their storage does not (a view of a larger
    base): the step leaves the plan at that pack, before anything of it moves."""
    schedule = MoveSchedule(actions={}, moved_slots=frozenset({0}), slots=(0,), forward_end=1, host_bytes=64,
                            slot_sid={0: 7}, slot_bytes={0: 64}, planned=(64,))
    pool = HostPool(1 << 20)
    moving = MovingStep(schedule, SyncCopyEngine(), pool, torch.device("cpu"), 1 << 20)
    told: list[str] = []
    moving.on_held = told.append
    base = torch.zeros(32)  # 128 bytes
    packed = moving.pack(base[:8], 0, 0, torch.Size([8]), torch.float32, 0)
    assert told and "storage 7 is 128 bytes, the plan's 64" in told[0]
    assert not moving.on_plan and len(packed) == 3 and packed[0] is not None
    assert not moving.slots  # nothing of it is moved
    fits = MovingStep(schedule, SyncCopyEngine(), pool, torch.device("cpu"), 1 << 20)
    fits.on_held = told.append
    assert len(fits.pack(torch.zeros(16)[:8], 0, 0, torch.Size([8]), torch.float32, 0)) == 6  # a handle
    assert fits.on_plan and len(told) == 1


def test_a_fast_step_leaves_no_reference_cycle_for_the_garbage_collector() -> None:
    """Each step's guard and moves are freed when the step's graph is, not at some later
    collection (a cycle through their callbacks left them, and all they held, to the
    garbage collector)."""
    budget = _budget_at(64, 0.5)
    session = OffloadSession(OffloadConfig(max_resident_activation_mb=budget / (1 << 20)))
    ws = _weights()
    for step in range(8):
        _run(session, _plain_body, ws, step)
    assert session.last_report is not None and session.last_report.replay_path == "fast"
    assert session.last_report.bytes_d2h > 0
    seen: list[weakref.ref] = []

    def body(x: torch.Tensor, ws: list[torch.Tensor], step: int) -> torch.Tensor:
        fast = session._fast
        assert fast is not None and fast.moving is not None
        seen.extend([weakref.ref(fast.guard), weakref.ref(fast.moving)])
        return _plain_body(x, ws, step)

    gc.collect()
    gc.disable()
    try:
        _run(session, body, ws, 8)
        assert session.last_report is not None and session.last_report.replay_path == "fast"
        assert [r() for r in seen] == [None, None]
    finally:
        gc.enable()


_ROUTED = [48] * 10 + [40, 32, 48, 56, 40]


def _routed(x: torch.Tensor, ws: list[torch.Tensor], step: int) -> torch.Tensor:
    """How many rows reach the second product depends on the data (an MoE expert's tokens):
    the first saved tensor is the same every step, a later one smaller or larger."""
    h = torch.tanh(x @ ws[0])
    picked = torch.index_select(h, 0, torch.arange(_ROUTED[step]))
    return (picked @ ws[1]).square().mean() + h.sin().mean()


def test_a_later_saved_tensor_smaller_than_the_plans_stays_fast_a_larger_one_departs() -> None:
    budget = _budget(_routed, 0.9)  # (lower, the re-plans for the fast path do not fit)
    _, reports = _steps(_routed, budget, [64] * len(_ROUTED))
    paths = [r.replay_path for r in reports]
    assert paths[9:13] == ["fast"] * 4, paths  # 40 and 32 rows: fast on the 48 plan
    assert all(r.bytes_d2h > 0 for r in reports[9:13]), reports
    assert paths[13] == "fallback" and reports[13].departed_at_saved, reports[13]  # 56: over
