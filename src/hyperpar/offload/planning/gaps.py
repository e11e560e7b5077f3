"""Eviction candidates: the stretches between two accesses of a storage.

A storage may leave the device between two consecutive accesses ``a < b`` that have at
least one op strictly between them; it is then off the device for the ops ``a+1 .. b-1``.
Its D2H copy may start right after the latest WRITE at or before ``a`` (``copy_op``),
never earlier, or the host copy would miss that write.
"""

from __future__ import annotations

from dataclasses import dataclass

from hyperpar.offload.ir import AccessKind, ActivationTrace


@dataclass(frozen=True, slots=True)
class Gap:
    sid: int
    start: int  # op of the access before the gap (release after it)
    end: int  # op of the access after the gap (the consumer)
    copy_op: int  # latest WRITE at or before ``start`` (D2H after it)
    size: int

    @property
    def length(self) -> int:
        return self.end - self.start


def find_gaps(trace: ActivationTrace) -> list[Gap]:
    """Every candidate gap, in op order of its start (ties: storage id)."""
    sizes = trace.storage_sizes
    pinned = trace.pinned_sids
    last_access: dict[int, int] = {}
    last_write: dict[int, int] = {}
    gaps: list[Gap] = []
    for i, op in enumerate(trace.ops):
        for acc in op.accesses:
            sid = acc.storage_id
            prev = last_access.get(sid)
            if prev is not None and i - prev >= 2 and sid not in pinned:
                gaps.append(Gap(sid, prev, i, last_write.get(sid, prev), sizes.get(sid, 0)))
            if prev is None and acc.kind is not AccessKind.WRITE:
                # First seen as a READ: its data exists from here on.
                last_write.setdefault(sid, i)
            if acc.kind is AccessKind.WRITE:
                last_write[sid] = i
            last_access[sid] = i
    gaps.sort(key=lambda g: (g.start, g.sid))
    return gaps


def greedy_order_key(gap: Gap) -> tuple[int, int, int, int]:
    """The reference's preference: longest gap first, then largest; ties by position."""
    return (-gap.length, -gap.size, gap.start, gap.sid)


def last_accesses(trace: ActivationTrace) -> dict[int, int]:
    """sid -> op of its last real access (retained storages included)."""
    last: dict[int, int] = {}
    for i, op in enumerate(trace.ops):
        for acc in op.accesses:
            last[acc.storage_id] = i
    return last
