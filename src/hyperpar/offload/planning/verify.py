"""Prove a schedule safe for a trace before replay runs it.

Walks the step in execution order (pre actions, the op's accesses, post actions) with
one small state per storage: on the device or not, whether a host copy exists, and
whether that copy has seen the storage's last write. Any way the schedule could lose or
corrupt data raises ``ScheduleError`` naming the op and the storage.
"""

from __future__ import annotations

from bisect import bisect_right
from collections import defaultdict

from hyperpar.offload.ir import AccessKind, ActivationTrace, ResidencySchedule
from hyperpar.offload.ir import ResidencyActionType as Act

_NEW, _ON_DEVICE, _RELEASED = 0, 1, 2


class ScheduleError(ValueError):
    """A schedule that would read missing or stale data, or free something twice."""

    def __init__(self, message: str, op: int | None = None, storage_id: int | None = None) -> None:
        super().__init__(message)
        self.op = op
        self.storage_id = storage_id


def verify(trace: ActivationTrace, schedule: ResidencySchedule) -> None:
    """Raise ``ScheduleError`` if replaying ``schedule`` on ``trace`` could go wrong."""
    n = trace.num_ops
    if len(schedule.pre) != n or len(schedule.post) != n:
        raise ScheduleError(
            f"schedule has {len(schedule.pre)} pre and {len(schedule.post)} post op slots "
            f"but the trace has {n} ops"
        )
    accessed_at: dict[int, list[int]] = defaultdict(list)
    for i, op in enumerate(trace.ops):
        for acc in op.accesses:
            accessed_at[acc.storage_id].append(i)
    device: dict[int, int] = {}
    released_at: dict[int, int] = {}
    version: dict[int, int] = defaultdict(int)
    host_version: dict[int, int] = {}  # present only while a host copy exists

    def where(i: int, phase: str) -> str:
        return f"op {i} ({trace.ops[i].name}) {phase}"

    def next_access(sid: int, i: int, phase: str) -> int | None:
        ops = accessed_at.get(sid, [])
        k = bisect_right(ops, i - 1 if phase == "pre" else i)
        return ops[k] if k < len(ops) else None

    def apply(i: int, phase: str, kind: Act, sid: int) -> None:
        if sid not in trace.storage_sizes:
            raise ScheduleError(f"{where(i, phase)}: {kind.value} of unknown storage {sid}", i, sid)
        state = device.get(sid, _NEW)
        if kind is Act.COPY_D2H:
            if sid in trace.pinned_sids:
                raise ScheduleError(
                    f"{where(i, phase)}: copy_d2h of storage {sid}, which is pinned to the device", i, sid
                )
            if state != _ON_DEVICE:
                raise ScheduleError(
                    f"{where(i, phase)}: copy_d2h of storage {sid}, which is not on the device", i, sid
                )
            host_version[sid] = version[sid]
        elif kind is Act.RELEASE_DEVICE:
            if state == _RELEASED:
                raise ScheduleError(
                    f"{where(i, phase)}: storage {sid} released twice (already at op {released_at[sid]})",
                    i, sid,
                )
            if state == _NEW:
                raise ScheduleError(
                    f"{where(i, phase)}: release of storage {sid} before it exists", i, sid
                )
            later = next_access(sid, i, phase)
            if later is not None and sid not in host_version:
                raise ScheduleError(
                    f"{where(i, phase)}: storage {sid} released without a host copy "
                    f"but op {later} still uses it", i, sid,
                )
            device[sid] = _RELEASED
            released_at[sid] = i
        elif kind is Act.COPY_H2D:
            if sid not in host_version:
                raise ScheduleError(
                    f"{where(i, phase)}: copy_h2d of storage {sid}, which has no host copy", i, sid
                )
            if state == _ON_DEVICE:
                raise ScheduleError(
                    f"{where(i, phase)}: copy_h2d of storage {sid}, which is already on the device",
                    i, sid,
                )
            if host_version[sid] != version[sid]:
                raise ScheduleError(
                    f"{where(i, phase)}: copy_h2d of storage {sid} brings back a stale host copy "
                    f"(written after it was copied out)", i, sid,
                )
            device[sid] = _ON_DEVICE
        elif kind is Act.RELEASE_HOST:
            if sid not in host_version:
                raise ScheduleError(
                    f"{where(i, phase)}: release_host of storage {sid}, which has no host copy "
                    f"(never copied or released twice)", i, sid,
                )
            del host_version[sid]

    for i, op in enumerate(trace.ops):
        for action in schedule.pre[i]:
            apply(i, "pre", action.kind, action.storage_id)
        for acc in op.accesses:
            sid = acc.storage_id
            state = device.get(sid, _NEW)
            if state == _RELEASED:
                verb = "reads" if acc.kind is AccessKind.READ else "writes"
                raise ScheduleError(
                    f"op {i} ({op.name}) {verb} storage {sid}, which is not resident "
                    f"(released at op {released_at[sid]} and not copied back)", i, sid,
                )
            device[sid] = _ON_DEVICE
            if acc.kind is AccessKind.WRITE:
                version[sid] += 1
        for action in schedule.post[i]:
            apply(i, "post", action.kind, action.storage_id)
    for sid in sorted(trace.retained_sids):
        if device.get(sid) == _RELEASED:
            raise ScheduleError(
                f"retained storage {sid} is not on the device at the end of the step "
                f"(released at op {released_at[sid]})", released_at[sid], sid,
            )
