"""The schedule emitter and the simulator as they were written before they worked on packed
arrays (one object per action, a Python step per op): the executable definition of what
``emit_schedule`` and ``simulate`` must produce, exactly, only faster."""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence

import numpy as np

from hyperpar.offload.ir import AccessKind, ActivationTrace, ResidencyAction, ResidencySchedule
from hyperpar.offload.ir import ResidencyActionType as Act
from hyperpar.offload.planning.arrays import TraceArrays, trace_arrays
from hyperpar.offload.planning.gaps import Gap
from hyperpar.offload.planning.simulate import LaneSpan, SimResult, ms_per_byte


def emit_reference(
    trace: ActivationTrace,
    chosen: Sequence[Gap],
    planner: str,
    h2d_ops: Sequence[int] | None = None,
    arrays: TraceArrays | None = None,
) -> ResidencySchedule:
    """``h2d_ops[k]`` is the op whose pre list issues the H2D of ``chosen[k]`` (default: its end)."""
    arr = arrays if arrays is not None else trace_arrays(trace)
    d2h: list[tuple[int, int]] = []
    frees: list[tuple[int, int]] = []
    h2d: list[tuple[int, int, int]] = []  # (issue op, consumer, sid): earlier consumers first
    # a tail leaves after its last access, copied out after its last write (or first access)
    copy_of: dict[int, int] = {}
    last_of: dict[int, int] = {}
    for i, op in enumerate(trace.ops):
        for acc in op.accesses:
            if acc.storage_id not in copy_of or acc.kind is AccessKind.WRITE:
                copy_of[acc.storage_id] = i
            last_of[acc.storage_id] = i
    tails = sorted(s for s in trace.tail_sids - trace.retained_sids - trace.pinned_sids if s in last_of)
    runs = [(g.sid, g.start, g.copy_op, k) for k, g in enumerate(chosen)]
    runs += [(s, last_of[s], copy_of[s], -1) for s in tails]
    prev_sid, copied_at = None, None
    for sid, _start, copy_op, k in sorted(runs):
        if sid != prev_sid:
            prev_sid, copied_at = sid, None
        if copied_at != copy_op:
            d2h.append((copy_op, sid))
            copied_at = copy_op
        if k < 0:
            continue
        gap = chosen[k]
        frees.append((gap.start, gap.sid))
        h2d.append((gap.end if h2d_ops is None else h2d_ops[k], gap.end, gap.sid))
    moved = {gap.sid for gap in chosen} | set(tails)
    last_frees: list[tuple[int, int]] = []
    host_frees: list[tuple[int, int]] = []
    retained = trace.retained_sids
    for sid, last, end in zip(arr.sids.tolist(), arr.last_op.tolist(), arr.end_op.tolist(), strict=True):
        if sid not in retained:
            last_frees.append((end, sid))
        if sid in moved:
            host_frees.append((last, sid))
    schedule = ResidencySchedule.empty(trace.num_ops, planner=planner)
    schedule.budget_bytes = trace.memory_limit_bytes
    post, pre = schedule.post, schedule.pre
    for items, kind in (
        (d2h, Act.COPY_D2H),
        (frees, Act.RELEASE_DEVICE),
        (last_frees, Act.RELEASE_DEVICE),
        (host_frees, Act.RELEASE_HOST),
    ):
        items.sort()
        for op, sid in items:
            post[op].append(ResidencyAction(kind, sid))
    h2d.sort()
    for op, _, sid in h2d:
        pre[op].append(ResidencyAction(Act.COPY_H2D, sid))
    return schedule


def simulate_reference(trace: ActivationTrace, schedule: ResidencySchedule) -> SimResult:
    arr = trace_arrays(trace)
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
    if trace.reserve_retained:  # the budget holds retained storages' bytes before they exist
        lifetimes = trace.lifetimes()
        for sid in trace.retained_sids:
            if sid in lifetimes:
                for i in range(lifetimes[sid][0]):
                    resident[i] += sizes.get(sid, 0)
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
