"""Steps of several lengths on the fast path: a plan whose saved tensors cover a shorter
step's (``covers``) runs it without the dispatch mode, bitwise and within the budget; a
longer step than any plan learned falls back at its first saved tensor and, once checked,
teaches its plan the longer length; from that fallback on, steps start checked and pick
their path at their first saved tensor; whatever departs inside a covered step (aliasing, a
storage larger than the plan's) is still caught."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from hyperpar.offload import OffloadConfig, OffloadSession
from hyperpar.offload.capture.checked.replay_state import SLACK_BYTES
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


def test_after_a_longer_step_fell_back_each_step_picks_its_path_at_its_first_saved_tensor() -> None:
    """After the first 64 fallback the structure's lengths vary: every step starts checked and
    hands off to the fast path at its first saved tensor where a plan covers it. 48 steps stay
    fast; a 64 step is checked, never a fallback again (its first plans the size, its second
    teaches the saved tensors), and fast from then on. Before, the fallback made the next four
    steps checked whatever their length, and each 64 step among passed ones fell back."""
    budget = _budget_at(64, 1.0)
    lengths = [48] * 8 + [64] + [48] * 5 + [64, 48, 48] + [64, 64, 64, 48, 64, 48]
    session, reports = _steps(_plain_body, budget, lengths)
    paths = [r.replay_path for r in reports]
    _settled(paths[:8])
    assert paths[8] == "fallback" and reports[8].departed_at_saved == 0, paths
    assert paths[9:14] == ["fast"] * 5, paths  # 48 covered: handed off at its first saved tensor
    assert paths[14:17] == ["checked", "fast", "fast"], paths  # 64: its size planned, 48 fast
    assert paths[17:] == ["checked"] + ["fast"] * 5, paths  # 64 learned: fast from here on
    assert all(r.checked_prefix_ops == 0 for r in reports[:9]), reports  # (no hand-off before)
    structure = next(iter(session._structures.values()))
    assert structure.varies and structure.departures == 0 and structure.to_learn == 0, structure


def _after_a_prefix(x: torch.Tensor, ws: list[torch.Tensor], step: int) -> torch.Tensor:
    """Ops that save nothing before the first saved tensor (the checked start runs them)."""
    h = (x * 2 + 1).clamp(-3, 3)
    h = h - h.mean(0)
    return _plain_body(h, ws, step)


def test_ops_before_the_first_saved_tensor_run_checked_then_the_step_goes_fast_bitwise() -> None:
    """(On the sync engine: a plan that moves a storage before the first saved tensor keeps
    its steps checked, and whether it does follows the storage deaths warmup recorded, which
    the chaos engine moves by holding copies' sources longer; the next test covers that.)"""
    budget = _budget(_after_a_prefix, 0.6)
    lengths = [64] * 6 + [80] + [64, 48, 56, 64] + [80, 80, 72]
    # bitwise; within the budget (an 80 step checked on the 64 plan: within replay's slack)
    _, reports = _steps(_after_a_prefix, budget, lengths, grown_slack=SLACK_BYTES, copy_engine="sync")
    paths = [r.replay_path for r in reports]
    assert paths[6] == "fallback", paths
    assert paths[7:11] == ["fast"] * 4, paths
    assert all(r.checked_prefix_ops == 5 for r in reports[7:11]), [r.checked_prefix_ops for r in reports]
    assert all(r.bytes_d2h > 0 for r in reports[7:11]), reports  # the handed-off steps move bytes
    assert paths[11:] == ["checked", "checked", "fast"], paths
    assert reports[-1].checked_prefix_ops == 5


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


def test_a_deciding_step_whose_checked_start_moved_bytes_stays_checked() -> None:
    """The fast path cannot follow what the checked start moved: no hand-off after a copy."""
    budget = _budget_at(64, 1.0)
    session, _ = _steps(_plain_body, budget, [64] * 4 + [80])  # the 80 step falls back: lengths vary
    moved: list[str | None] = []

    def body(x: torch.Tensor, ws: list[torch.Tensor], step: int) -> torch.Tensor:
        session._manager.bytes_d2h += 1  # as if the plan had copied a storage out before this
        return _plain_body(x, ws, step)

    ws = _weights()
    for step in range(2):
        _run(session, body, ws, step, 64)
        assert session.last_report is not None
        moved.append(session.last_report.replay_path)
        _run(session, _plain_body, ws, step, 64)
        assert session.last_report is not None and session.last_report.replay_path == "fast"
    assert moved == ["checked", "checked"], moved
