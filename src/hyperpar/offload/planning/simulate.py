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

``simulate`` assumes ``verify`` passed. Cost: linear in ops, accesses and actions,
plus a binary search per release.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass, field

import numpy as np

from hyperpar.offload.ir import ActivationTrace, ResidencyAction, ResidencySchedule
from hyperpar.offload.ir import ResidencyActionType as Act
from hyperpar.offload.planning.arrays import TraceArrays, trace_arrays
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
    arrive: dict[int, float] = {}  # sid -> end of its latest H2D
    left: dict[int, float] = {}  # sid -> end of its latest D2H
    # sid -> first op its current device allocation counts at (the first access allocates)
    open_from: dict[int, int] = dict(zip(arr.sids.tolist(), arr.first_op.tolist(), strict=True))
    # (first op, last op before any D2H extension, D2H end, size)
    spans: list[tuple[int, int, float, int]] = []
    d2h_lane: list[LaneSpan] = []
    h2d_lane: list[LaneSpan] = []
    d2h_free = h2d_free = 0.0
    bytes_d2h = bytes_h2d = 0
    pre, post = schedule.pre, schedule.post
    copy_d2h, copy_h2d, release = Act.COPY_D2H, Act.COPY_H2D, Act.RELEASE_DEVICE
    # only storages that are ever copied can make an op wait
    moved = {a.storage_id for acts in (*pre, *post) if acts for a in acts
             if a.kind is copy_d2h or a.kind is copy_h2d}
    waits_on: dict[int, list[tuple[int, bool]]] = {}
    if moved:
        pick = np.flatnonzero(np.isin(arr.access_sid, np.fromiter(moved, dtype=np.int64, count=len(moved))))
        for op, sid, write in zip(arr.access_op[pick].tolist(), arr.access_sid[pick].tolist(),
                                  arr.access_write[pick].tolist(), strict=True):
            waits_on.setdefault(op, []).append((sid, write))
    durations = arr.duration_ms.tolist()
    starts: list[float] = [0.0] * n
    ends: list[float] = [0.0] * n
    waits: list[float] = [0.0] * n
    clock = 0.0

    def run_actions(actions: list[ResidencyAction], counts_from: int) -> None:
        """Issue one pre/post list at ``clock``; allocations count from op ``counts_from``."""
        nonlocal d2h_free, h2d_free, bytes_d2h, bytes_h2d
        for action in actions:
            kind, sid = action.kind, action.storage_id
            if kind is release:
                first = open_from.pop(sid, None)
                if first is not None:
                    spans.append((first, counts_from - 1, left.get(sid, 0.0), sizes.get(sid, 0)))
            elif kind is copy_d2h:
                size = sizes.get(sid, 0)
                begin = max(clock, d2h_free, arrive.get(sid, 0.0))
                d2h_free = begin + size * d2h_cost
                left[sid] = d2h_free
                d2h_lane.append((begin, d2h_free, sid))
                bytes_d2h += size
            elif kind is copy_h2d:
                size = sizes.get(sid, 0)
                begin = max(clock, h2d_free, left.get(sid, 0.0))
                h2d_free = begin + size * h2d_cost
                arrive[sid] = h2d_free
                h2d_lane.append((begin, h2d_free, sid))
                bytes_h2d += size
                open_from[sid] = counts_from

    for i in range(n):  # a plain loop: this is the simulator's hot path (200k ops in < 1 s)
        if pre[i]:
            run_actions(pre[i], i)
        start = clock
        deps = waits_on.get(i)
        if deps is not None:
            for sid, write in deps:
                t = arrive.get(sid, 0.0)
                if t > start:
                    start = t
                if write:
                    t = left.get(sid, 0.0)
                    if t > start:
                        start = t
            waits[i] = start - clock
        starts[i] = start
        clock = start + durations[i]
        ends[i] = clock
        if post[i]:
            run_actions(post[i], i + 1)

    delta = [0] * (n + 1)
    for first, last, d2h_end, size in spans:
        if d2h_end > 0.0:
            last = max(last, bisect_left(starts, d2h_end) - 1)
        if last >= first:
            delta[first] += size
            delta[min(last, n - 1) + 1] -= size
    for sid, first in open_from.items():
        delta[first] += sizes.get(sid, 0)
    resident, running = [], 0
    for i in range(n):
        running += delta[i]
        resident.append(running)
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
