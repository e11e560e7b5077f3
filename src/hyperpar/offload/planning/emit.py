"""Turn chosen gaps into per-op actions, the same way for every planner.

Per storage, in op order: COPY_D2H after the gap's copy op unless the host copy is
still current (no write since the previous D2H), RELEASE_DEVICE after the gap start,
COPY_H2D before ``h2d_op`` (the consumer, or earlier for a prefetch); after the last
access RELEASE_DEVICE (unless retained) and RELEASE_HOST if it was ever copied out.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

from hyperpar.offload.ir import ActivationTrace, ResidencyAction, ResidencySchedule
from hyperpar.offload.ir import ResidencyActionType as Act
from hyperpar.offload.planning.gaps import Gap, last_accesses


def emit_schedule(
    trace: ActivationTrace,
    chosen: Sequence[Gap],
    planner: str,
    h2d_ops: Sequence[int] | None = None,
) -> ResidencySchedule:
    """``h2d_ops[k]`` is the op whose pre list issues the H2D of ``chosen[k]`` (default: its end)."""
    n = trace.num_ops
    # (op, category, sid, action): sorted so each list has D2H, releases, then host releases.
    post_items: list[tuple[int, int, int, ResidencyAction]] = []
    pre_items: list[tuple[int, int, int, ResidencyAction]] = []
    by_sid: dict[int, list[tuple[Gap, int]]] = defaultdict(list)
    for k, gap in enumerate(chosen):
        by_sid[gap.sid].append((gap, gap.end if h2d_ops is None else h2d_ops[k]))
    for sid, items in by_sid.items():
        items.sort(key=lambda item: item[0].start)
        copied_at: int | None = None
        for gap, h2d_op in items:
            if copied_at != gap.copy_op:
                post_items.append((gap.copy_op, 0, sid, ResidencyAction(Act.COPY_D2H, sid)))
                copied_at = gap.copy_op
            post_items.append((gap.start, 1, sid, ResidencyAction(Act.RELEASE_DEVICE, sid)))
            pre_items.append((h2d_op, 0, sid, ResidencyAction(Act.COPY_H2D, sid)))
    for sid, last in last_accesses(trace).items():
        if sid not in trace.retained_sids:
            post_items.append((last, 2, sid, ResidencyAction(Act.RELEASE_DEVICE, sid)))
        if sid in by_sid:
            post_items.append((last, 3, sid, ResidencyAction(Act.RELEASE_HOST, sid)))
    schedule = ResidencySchedule.empty(n, planner=planner)
    schedule.budget_bytes = trace.memory_limit_bytes
    for op, _, _, action in sorted(post_items, key=lambda t: t[:3]):
        schedule.post[op].append(action)
    for op, _, _, action in sorted(pre_items, key=lambda t: t[:3]):
        schedule.pre[op].append(action)
    return schedule
