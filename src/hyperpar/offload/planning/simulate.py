"""Replay a schedule on the trace's timeline: the yardstick for planners.

Timing model (three lanes):
- Compute runs the ops in order. Op ``i`` starts when op ``i-1`` has finished, every
  storage it accesses has arrived (its in-flight H2D, if any, is done) and every storage
  it WRITES has left (its in-flight D2H, if any, is done). The difference between that
  start and the end of op ``i-1`` is exposed wait.
- Actions are issued when compute reaches them: a ``pre`` action at the end of op
  ``i-1``, a ``post`` action at the end of op ``i``.
- One D2H lane and one H2D lane each run their copies one at a time in issue order; a
  copy of ``size`` bytes takes ``size / (GB/s * 1e9)`` seconds at the trace's bandwidth
  (a bandwidth of 0, i.e. not measured, counts as infinitely fast). A D2H waits for an
  in-flight H2D of the same storage, an H2D for an in-flight D2H of it.

Memory model (activation bytes on the device while op ``k`` runs):
- a storage counts from its first access (which allocates it), or from the op its
  COPY_H2D is issued before (in-flight copies count against the device from issue);
- a RELEASE_DEVICE stops the count after the op it follows, except that memory being
  copied out stays counted until its D2H completes: through every op that starts
  before that.

``simulate`` assumes ``verify`` passed. It reads the schedule's packed actions: storages
never copied are counted with array operations, and Python visits only the ops that act on,
or access, a storage that is copied (``ComputeLane`` fills in the others' times).
"""

from __future__ import annotations

from array import array
from bisect import bisect_left
from dataclasses import dataclass, field

import numpy as np

from hyperpar.offload.ir import ActivationTrace, ResidencySchedule
from hyperpar.offload.ir import ResidencyActionType as Act
from hyperpar.offload.ir.packed_schedule import KINDS, packed_actions
from hyperpar.offload.ir.sorted_ids import sorted_distinct
from hyperpar.offload.planning.arrays import TraceArrays, trace_arrays, with_reserve
from hyperpar.offload.planning.compute_lane import ComputeLane
from hyperpar.offload.planning.gc_pause import gc_paused

# (start_ms, end_ms, storage id) of one copy on a transfer lane.
LaneSpan = tuple[float, float, int]


@dataclass
class SimResult:
    predicted_step_ms: float
    compute_ms: float  # sum of op durations: the step without offload
    exposed_wait_ms: float
    resident_bytes: list[int]
    peak_resident_bytes: int
    peak_op: int | None
    op_start_ms: list[float] = field(repr=False, default_factory=list)
    op_end_ms: list[float] = field(repr=False, default_factory=list)
    op_wait_ms: list[float] = field(repr=False, default_factory=list)
    d2h_lane: list[LaneSpan] = field(repr=False, default_factory=list)
    h2d_lane: list[LaneSpan] = field(repr=False, default_factory=list)
    bytes_d2h: int = 0
    bytes_h2d: int = 0

    @property
    def overhead(self) -> float:
        """Predicted step time over the step without offload, minus one."""
        if self.compute_ms <= 0:
            return 0.0
        return max(0.0, self.predicted_step_ms / self.compute_ms - 1.0)  # never below: float noise


def ms_per_byte(gbps: float) -> float:
    return 0.0 if gbps <= 0 else 1.0 / (gbps * 1e6)


def simulate(
    trace: ActivationTrace, schedule: ResidencySchedule, arrays: TraceArrays | None = None
) -> SimResult:
    n = trace.num_ops
    if schedule.num_ops != n:
        raise ValueError(f"schedule has {schedule.num_ops} ops but the trace has {n}")
    with gc_paused():
        return _simulate(trace, schedule, arrays if arrays is not None else trace_arrays(trace))


def _simulate(trace: ActivationTrace, schedule: ResidencySchedule, arr: TraceArrays) -> SimResult:
    n = trace.num_ops
    sizes = trace.storage_sizes
    d2h_cost, h2d_cost = ms_per_byte(trace.d2h_bandwidth_gbps), ms_per_byte(trace.h2d_bandwidth_gbps)
    bounds, kind_bytes, sid_array = packed_actions(schedule)
    kind, act_sid = _np(kind_bytes, np.uint8), _np(sid_array, np.int64)
    act_list = np.repeat(np.arange(2 * n, dtype=np.int64), np.diff(_np(bounds, np.int64)))
    # only storages that are ever copied can make an op wait or outlive a release; the
    # releases of every other storage are counted below at once, not one by one
    moved_ids = sorted_distinct(act_sid[(kind == _D2H) | (kind == _H2D)])
    on_moved = np.isin(act_sid, moved_ids)
    delta = np.zeros(n + 1, dtype=np.int64)
    _count_unmoved(arr, act_list, act_sid, (kind == _RELEASE) & ~on_moved, moved_ids, delta)
    arrive: dict[int, float] = {}  # sid -> end of its latest H2D
    left: dict[int, float] = {}  # sid -> end of its latest D2H
    # moved sid -> first op its current device allocation counts at (the first access allocates)
    dense_moved = np.isin(arr.sids, moved_ids)
    open_from: dict[int, int] = dict(zip(arr.sids[dense_moved].tolist(), arr.first_op[dense_moved].tolist(),
                                         strict=True))
    # (first op, last op before any D2H extension, D2H end, size)
    spans: list[tuple[int, int, float, int]] = []
    d2h_lane: list[LaneSpan] = []
    h2d_lane: list[LaneSpan] = []
    d2h_free = h2d_free = 0.0
    bytes_d2h = bytes_h2d = 0
    pre: dict[int, list[tuple[int, int]]] = {}  # op -> its pre actions on moved storages
    post: dict[int, list[tuple[int, int]]] = {}
    pick = np.flatnonzero(on_moved & (kind != _RELEASE_HOST))
    for j, code, sid in zip(act_list[pick].tolist(), kind[pick].tolist(), act_sid[pick].tolist(),
                            strict=True):
        (post if j & 1 else pre).setdefault(j >> 1, []).append((code, sid))
    waits_on: dict[int, list[tuple[int, bool]]] = {}
    if len(moved_ids):
        pick = np.flatnonzero(np.isin(arr.access_sid, moved_ids))
        for op, sid, write in zip(arr.access_op[pick].tolist(), arr.access_sid[pick].tolist(),
                                  arr.access_write[pick].tolist(), strict=True):
            waits_on.setdefault(op, []).append((sid, write))
    lane = ComputeLane(arr.duration_ms)
    waits: list[float] = [0.0] * n
    clock = 0.0
    copy_d2h, copy_h2d = _D2H, _H2D

    def run_actions(actions: list[tuple[int, int]], counts_from: int) -> None:
        """Issue one pre/post list at ``clock``; allocations count from op ``counts_from``."""
        nonlocal d2h_free, h2d_free, bytes_d2h, bytes_h2d
        for kind, sid in actions:
            if kind == copy_d2h:
                size = sizes.get(sid, 0)
                begin = max(clock, d2h_free, arrive.get(sid, 0.0))
                d2h_free = begin + size * d2h_cost
                left[sid] = d2h_free
                d2h_lane.append((begin, d2h_free, sid))
                bytes_d2h += size
            elif kind == copy_h2d:
                size = sizes.get(sid, 0)
                begin = max(clock, h2d_free, left.get(sid, 0.0))
                h2d_free = begin + size * h2d_cost
                arrive[sid] = h2d_free
                h2d_lane.append((begin, h2d_free, sid))
                bytes_h2d += size
                open_from[sid] = counts_from
            else:  # a release
                first = open_from.pop(sid, None)
                if first is not None:
                    spans.append((first, counts_from - 1, left.get(sid, 0.0), sizes.get(sid, 0)))

    # only ops that issue actions on moved storages or read them can change the timeline
    for i in sorted(pre.keys() | post.keys() | waits_on.keys()):
        clock = lane.before(i)
        acts = pre.get(i)
        if acts is not None:
            run_actions(acts, i)
        deps = waits_on.get(i)
        if deps is not None:
            start = clock
            for sid, write in deps:
                t = arrive.get(sid, 0.0)
                if t > start:
                    start = t
                if write:
                    t = left.get(sid, 0.0)
                    if t > start:
                        start = t
            if start > clock:
                lane.wait(i, start)
                waits[i] = start - clock
        acts = post.get(i)
        if acts is not None:
            clock = lane.after(i)
            run_actions(acts, i + 1)
    starts, ends = lane.finish()
    clock = ends[-1] if n else 0.0

    for first, last, d2h_end, size in spans:
        if d2h_end > 0.0:
            last = max(last, bisect_left(starts, d2h_end) - 1)
        if last >= first:
            delta[first] += size
            delta[min(last, n - 1) + 1] -= size
    for sid, first in open_from.items():
        delta[first] += sizes.get(sid, 0)
    resident: list[int] = with_reserve(np.cumsum(delta[:n]), arr).tolist()
    peak = max(resident, default=0)
    step = max(clock, d2h_free, h2d_free)
    return SimResult(
        predicted_step_ms=step,
        compute_ms=float(arr.duration_ms.sum()),
        exposed_wait_ms=sum(waits),
        resident_bytes=resident,
        peak_resident_bytes=peak,
        peak_op=resident.index(peak) if resident else None,
        op_start_ms=starts,
        op_end_ms=ends,
        op_wait_ms=waits,
        d2h_lane=d2h_lane,
        h2d_lane=h2d_lane,
        bytes_d2h=bytes_d2h,
        bytes_h2d=bytes_h2d,
    )


_D2H, _H2D, _RELEASE, _RELEASE_HOST = (
    KINDS.index(k) for k in (Act.COPY_D2H, Act.COPY_H2D, Act.RELEASE_DEVICE, Act.RELEASE_HOST))


def _np(values: array | bytes, dtype: type) -> np.ndarray:
    return np.frombuffer(values, dtype=dtype) if len(values) else np.zeros(0, dtype=dtype)


def _count_unmoved(arr: TraceArrays, act_list: np.ndarray, act_sid: np.ndarray, release: np.ndarray,
                   moved_ids: np.ndarray, delta: np.ndarray) -> None:
    """Add to ``delta`` the bytes of every storage never copied: from its first access to the op
    before its first release (a pre list of op i counts through op i-1, a post list through i),
    or to the end of the step when none releases it."""
    if not len(arr.sids):
        return
    n = arr.num_ops
    sid = act_sid[release]
    where = np.minimum(np.searchsorted(arr.sids, sid), len(arr.sids) - 1)
    known = arr.sids[where] == sid
    counts_to = np.full(len(arr.sids), n + 1, dtype=np.int64)  # n + 1: never released
    np.minimum.at(counts_to, where[known], (act_list[release][known] + 1) >> 1)
    unmoved = ~np.isin(arr.sids, moved_ids)
    first, size = arr.first_op, arr.size
    released = unmoved & (counts_to <= n)
    last = counts_to - 1
    span = released & (last >= first)
    np.add.at(delta, first[span], size[span])
    np.add.at(delta, np.minimum(last[span], n - 1) + 1, -size[span])
    kept = unmoved & ~released
    np.add.at(delta, first[kept], size[kept])
