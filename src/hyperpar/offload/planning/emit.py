"""Turn chosen gaps into per-op actions, the same way for every planner.

Per storage, in op order: COPY_D2H after the gap's copy op unless the host copy is
still current (no write since the previous D2H), RELEASE_DEVICE after the gap start,
COPY_H2D before ``h2d_op`` (the consumer, or earlier for a prefetch); after the last
access RELEASE_DEVICE (unless retained) and RELEASE_HOST if it was ever copied out.
Each post list holds D2H copies, then releases, then host releases; each kind by sid.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from hyperpar.offload.ir import ActivationTrace, ResidencyAction, ResidencySchedule
from hyperpar.offload.ir import ResidencyActionType as Act
from hyperpar.offload.planning.arrays import TraceArrays, trace_arrays
from hyperpar.offload.planning.gaps import Gap


def emit_schedule(
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
    order = sorted(range(len(chosen)), key=lambda k: (chosen[k].sid, chosen[k].start))
    prev_sid, copied_at = None, None
    for k in order:
        gap = chosen[k]
        if gap.sid != prev_sid:
            prev_sid, copied_at = gap.sid, None
        if copied_at != gap.copy_op:
            d2h.append((gap.copy_op, gap.sid))
            copied_at = gap.copy_op
        frees.append((gap.start, gap.sid))
        h2d.append((gap.end if h2d_ops is None else h2d_ops[k], gap.end, gap.sid))
    moved = {gap.sid for gap in chosen}
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


def as_gaps(starts: np.ndarray, ends: np.ndarray, copy_ops: np.ndarray, sids: np.ndarray,
            sizes: np.ndarray) -> list[Gap]:
    return [
        Gap(s, a, b, c, z)
        for s, a, b, c, z in zip(sids.tolist(), starts.tolist(), ends.tolist(), copy_ops.tolist(),
                                 sizes.tolist(), strict=True)
    ]
