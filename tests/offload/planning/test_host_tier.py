"""The disk tier's estimate on hand-made plans, for its online policy (``disk_plan=False``: the
first step's, before a plan; ``test_disk_plan`` covers a plan's steps): which copies go to
disk, what comes back, I/O time."""

from __future__ import annotations

import dataclasses
import functools

import pytest

from hyperpar.offload.ir import ActivationTrace, ResidencyAction, ResidencySchedule
from hyperpar.offload.ir import ResidencyActionType as Act
from hyperpar.offload.planning import host_tier as model
from hyperpar.offload.planning import simulate, verify
from hyperpar.offload.planning.host_tier import host_tier
from hyperpar.offload.runtime import disk_tier
from tests.offload.planning.trace_builders import make_trace

online = functools.partial(host_tier, disk_plan=False)
M = 1_000_000  # one storage; GB/s are 1e9 bytes a second, so M bytes at 1 GB/s take 1 ms
CODES = {"d2h": Act.COPY_D2H, "h2d": Act.COPY_H2D, "free": Act.RELEASE_DEVICE, "freehost": Act.RELEASE_HOST}


def _four(ms: float = 1.0) -> ActivationTrace:
    """Forward writes storages 0..3 (op i writes i), backward reads them in reverse (op 4 + k reads 3 - k)."""
    ops = [(f"w{i}", ms) for i in range(4)] + [(f"r{3 - k}", ms) for k in range(4)]
    return make_trace(ops, {i: M for i in range(4)}, budget=M)


def _schedule(actions: dict[tuple[int, str], str]) -> ResidencySchedule:
    """``{(op, "pre" | "post"): "d2h 0, free 0"}`` as a schedule of the eight ops."""
    schedule = ResidencySchedule.empty(8, "hand")
    for (op, where, ), text in actions.items():
        acts = [ResidencyAction(CODES[w.split()[0]], int(w.split()[1])) for w in text.split(",")]
        (schedule.pre if where == "pre" else schedule.post)[op].extend(acts)
    return schedule


def _offload_all(prefetch: bool) -> ResidencySchedule:
    """Every storage copied out and released after its op; copied in before its reader (``prefetch``:
    one op earlier as well), released for good after it."""
    acts = {(i, "post"): f"d2h {i}, free {i}" for i in range(4)}
    for k in range(4):
        acts[4 + k, "post"] = f"free {3 - k}, freehost {3 - k}"
        acts[4 + k, "pre"] = f"h2d {3 - k}"
    if prefetch:
        acts[4, "pre"] = "h2d 3, h2d 2"
        for k in range(1, 3):
            acts[4 + k, "pre"] = f"h2d {2 - k}"
        del acts[7, "pre"]
    return _schedule(acts)


@pytest.mark.parametrize("prefetch", [False, True])
def test_the_schedules_are_valid(prefetch: bool) -> None:
    verify(_four(), _offload_all(prefetch))


def test_budget_of_two_spills_the_three_oldest_and_reads_them_on_demand() -> None:
    est = online(_four(), _offload_all(prefetch=False), 2 * M)
    assert est.peak_host_bytes == 4 * M  # no budget: all four copies on host after forward
    # each eviction past half the budget (one copy) writes the oldest: 0 at 1's, 1 at 2's, 2 at 3's
    assert est.spilled_sids == (0, 1, 2) and est.bytes_to_disk == 3 * M
    # a copy back on the device is still in flight when the next read could start: no read ahead
    assert est.bytes_from_disk == 3 * M and est.demand_reads == 3
    assert est.peak_host_bytes_budgeted == 2 * M and est.kept_on_device_bytes == 0


def test_reads_ahead_bring_copies_back_before_the_device_asks() -> None:
    est = online(_four(), _offload_all(prefetch=True), 3 * M)
    # past half of 3 at each eviction from the second on, the copy needed last goes: 0, 1, 2
    assert est.spilled_sids == (0, 1, 2)
    assert est.bytes_from_disk == 3 * M and est.demand_reads == 0  # all read back ahead of need
    assert est.peak_host_bytes_budgeted == 2 * M


def test_a_budget_that_holds_the_plans_copies_writes_nothing_ahead() -> None:
    est = online(_four(), _offload_all(prefetch=True), 4 * M)  # the host peak exactly
    assert est.peak_host_bytes == 4 * M and est.bytes_to_disk == 0 and est.spilled_sids == ()


def test_a_budget_twice_the_peak_never_writes() -> None:
    est = online(_four(), _offload_all(prefetch=True), 8 * M)
    assert est.bytes_to_disk == est.bytes_from_disk == 0 and est.spilled_sids == ()
    assert est.peak_host_bytes_budgeted == est.peak_host_bytes == 4 * M
    assert est.io_ms == 0 and est.fits


def test_a_budget_smaller_than_a_copy_keeps_it_on_the_device() -> None:
    est = online(_four(), _offload_all(prefetch=False), M // 2)
    assert est.kept_on_device_bytes == 4 * M and est.bytes_to_disk == 0
    assert est.peak_host_bytes_budgeted == 0


def test_io_time_against_compute() -> None:
    est = online(_four(ms=1.0), _offload_all(prefetch=False), 2 * M, write_gbps=2.0, read_gbps=1.0)
    assert (est.write_ms, est.read_ms) == pytest.approx((1.5, 3.0))
    assert est.compute_ms == 8.0 and est.fits
    tight = online(_four(ms=0.5), _offload_all(prefetch=False), 2 * M, write_gbps=2.0, read_gbps=1.0)
    assert tight.io_ms == pytest.approx(4.5) and tight.compute_ms == 4.0 and not tight.fits
    doc = tight.as_dict()
    assert doc["fits"] is False and doc["bytes_to_disk"] == 3 * M and "spilled_sids" not in doc


def test_the_marks_are_the_runtimes() -> None:
    assert (model.SPILL_AT, model.READ_AT) == (disk_tier.SPILL_AT, disk_tier.READ_AT)
    assert model.SMALL_BYTES == disk_tier.SMALL_BYTES


@pytest.mark.parametrize(("budget", "write", "read"), [(-1, 1.0, 1.0), (M, 0.0, 1.0), (M, 1.0, -2.0)])
def test_bad_arguments(budget: int, write: float, read: float) -> None:
    with pytest.raises(ValueError, match="bandwidths > 0"):
        online(_four(), _offload_all(prefetch=False), budget, write, read)


def test_a_schedule_of_another_trace() -> None:
    with pytest.raises(ValueError, match="schedule has 3 ops but the trace has 8"):
        online(_four(), ResidencySchedule.empty(3), M)


def test_the_files_high_water_mark() -> None:
    assert online(_four(), _offload_all(prefetch=False), 2 * M).peak_disk_bytes == 3 * M
    # with reads ahead at 3: 0, 1 and 2 on disk together before backward reads any back
    assert online(_four(), _offload_all(prefetch=True), 3 * M).peak_disk_bytes == 3 * M


def zero_back_first() -> tuple[ActivationTrace, ResidencySchedule]:
    """``_four``'s storages, evicted in forward; backward reads 0 first, then 3, 2, 1."""
    ops = [(f"w{i}", 1.0) for i in range(4)] + [("r0", 1.0), ("r3", 1.0), ("r2", 1.0), ("r1", 1.0)]
    trace = make_trace(ops, {i: M for i in range(4)}, budget=M)
    acts = {(i, "post"): f"d2h {i}, free {i}" for i in range(4)}
    for k, sid in enumerate((0, 3, 2, 1)):
        acts[4 + k, "pre"] = f"h2d {sid}"
        acts[4 + k, "post"] = f"free {sid}, freehost {sid}"
    return trace, _schedule(acts)


def test_the_copy_the_plan_brings_back_last_is_written_first() -> None:
    """Storage 0 is read first in backward (an encoder output, say) though it left first: by age it
    would go to disk first; by the plan's order (the runtime's on every planned step) 3 and 2 go."""
    trace, schedule = zero_back_first()
    verify(trace, schedule)
    est = online(trace, schedule, 2 * M)
    # evictions past one copy: at 1's, of 0 and 1 the later one back (1); at 2's, of 0 and 2: 2;
    # at 3's, of 0 and 3: 3 (back second, after 0)
    assert est.spilled_sids == (1, 2, 3)
    assert 0 not in est.spilled_sids, "the copy needed first in backward went to disk"


def test_the_warning_says_io_the_step_cannot_hide_and_copies_with_no_room() -> None:
    slow = online(_four(ms=0.1), _offload_all(prefetch=False), 2 * M, write_gbps=1.0, read_gbps=1.0)
    said = slow.warning(step_ms=1.0)  # 3 MB out and back at 1 GB/s: 6 ms of I/O against a 1 ms step
    assert said is not None and "longer than the step (1.0 ms)" in said and "6.0 ms a step" in said
    assert slow.warning(step_ms=100.0) is None  # hidden under a long step
    tight = online(_four(), _offload_all(prefetch=False), M // 2)
    said = tight.warning(step_ms=1e6)
    assert said is not None and "stay on the device" in said


def _timed(prefetch: bool, budget: int, write: float, read: float) -> model.HostTierEstimate:
    trace, schedule = _four(ms=1.0), _offload_all(prefetch)
    return online(trace, schedule, budget, write, read, timeline=simulate(trace, schedule))


def test_timed_reads_on_demand_make_the_step_wait_for_each() -> None:
    """1 GB/s both ways: M bytes take 1 ms. Writes of 0, 1, 2 start at ops 1-3's ends (2, 3, 4)
    and end at 3, 4, 5; nothing is read ahead (a copy back is in flight); backward's reads of 2,
    1 and 0 are on demand at ops 5, 6 and 7, each the step waits 1 ms for: 3 ms."""
    est = _timed(False, 2 * M, 1.0, 1.0)
    assert est.demand_reads == 3 and est.disk_wait_ms == pytest.approx(3.0)
    assert est.disk_wait_on_demand_ms == pytest.approx(3.0) and est.disk_wait_room_ms == 0.0
    assert est.step_ms == pytest.approx(8.0) and est.step_with_disk_ms == pytest.approx(11.0)
    assert "the step waits 3.0 ms for the disk" in (est.warning(8.0) or "")
    fast = _timed(False, 2 * M, 1000.0, 1000.0)  # the same I/O on a disk 1000x faster
    assert fast.disk_wait_ms == pytest.approx(0.003) and fast.warning(8.0) is None
    assert _timed(False, 8 * M, 1.0, 1.0).disk_wait_ms == 0.0  # the host holds every copy


def test_timed_room_in_a_slab_still_being_written_waits_for_the_write() -> None:
    """Forward ops of 10 ms, backward ops of 100 ms (its reads find their writes long done);
    writes at 0.09 GB/s (11.1 ms a copy), reads 1000x faster. Op 1's end writes 0 (20 ->
    31.1); op 2's copy out at 30 needs that slab: waits 1.1 ms, then writes 1 (to 42.2); op 3's
    copy out (at 41.1) waits for it too, 1.1 ms more; the three reads on demand take 1 us each."""
    ops = [(f"w{i}", 10.0) for i in range(4)] + [(f"r{3 - k}", 100.0) for k in range(4)]
    trace, schedule = make_trace(ops, {i: M for i in range(4)}, budget=M), _offload_all(prefetch=False)
    est = online(trace, schedule, 2 * M, 0.09, 1000.0, timeline=simulate(trace, schedule))
    assert est.disk_wait_ms == pytest.approx(2 * (M / 0.09e6 - 10.0) + 0.003)
    assert est.disk_wait_room_ms == pytest.approx(2 * (M / 0.09e6 - 10.0))
    assert est.disk_wait_on_demand_ms == pytest.approx(0.003) and est.disk_wait_read_ahead_ms == 0.0
    untimed = online(trace, schedule, 2 * M, 0.09, 1000.0)
    assert untimed.disk_wait_ms is None and untimed.step_with_disk_ms is None
    assert (untimed.spilled_sids, untimed.bytes_from_disk) == (est.spilled_sids, est.bytes_from_disk)


def test_a_timeline_of_another_trace() -> None:
    sim = simulate(_four(), _offload_all(prefetch=False))
    short = dataclasses.replace(sim, op_start_ms=sim.op_start_ms[:3], op_end_ms=sim.op_end_ms[:3])
    with pytest.raises(ValueError, match="timeline has 3 ops but the trace has 8"):
        online(_four(), _offload_all(prefetch=False), M, timeline=short)
