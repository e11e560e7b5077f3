"""A trace flattened into numpy arrays, so planners scale to hundreds of thousands of ops."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace

import numpy as np

from hyperpar.offload.ir import AccessKind, ActivationTrace
from hyperpar.offload.ir.packed import PackedTrace
from hyperpar.offload.ir.sorted_ids import sorted_distinct


@dataclass(frozen=True)
class TraceArrays:
    num_ops: int
    # one row per access, in op order
    access_op: np.ndarray
    access_sid: np.ndarray  # original storage id
    access_write: np.ndarray  # bool
    access_size: np.ndarray
    duration_ms: np.ndarray  # per op
    # per storage (dense index d; ``sids[d]`` is the storage id)
    sids: np.ndarray
    first_op: np.ndarray
    last_op: np.ndarray  # last real access
    end_op: np.ndarray  # last op it occupies the device (death, or n-1 when retained)
    size: np.ndarray
    pinned_sids: np.ndarray  # storage ids no schedule may move (sorted)
    # per op, bytes the budget holds for retained storages not yet allocated there (a trace
    # with ``reserve_retained``; None: none). Every residency count of planning adds them.
    reserve_bytes: np.ndarray | None = None
    # backward's first op: only gaps whose bytes were last written before it and that end at
    # or after it are candidates (None: any). A plan for the fast path, which copies a storage
    # out at a saved-tensor event in forward and back in backward, never both within forward
    # nor out within backward (a step with calls rebuilt in backward saves tensors there too)
    gap_boundary: int | None = None


# Arrays a caller already has for a trace (see ``arrays_given``): id(trace) -> (trace, arrays)
_GIVEN: dict[int, tuple[ActivationTrace, TraceArrays]] = {}


@contextmanager
def arrays_given(trace: ActivationTrace, arrays: TraceArrays) -> Iterator[None]:
    """While planning ``trace``, ``trace_arrays(trace)`` returns ``arrays`` (the session has
    them from the packed trace, and every planner, the simulator and the floor want them)."""
    _GIVEN[id(trace)] = (trace, arrays)
    try:
        yield
    finally:
        _GIVEN.pop(id(trace), None)


def trace_arrays(trace: ActivationTrace) -> TraceArrays:
    given = _GIVEN.get(id(trace))
    if given is not None and given[0] is trace:
        return given[1]
    ops = trace.ops
    n = len(ops)
    counts = np.fromiter((len(op.accesses) for op in ops), dtype=np.int64, count=n)
    access_sid = np.fromiter((a.storage_id for op in ops for a in op.accesses), dtype=np.int64)
    write = AccessKind.WRITE
    access_write = np.fromiter((a.kind is write for op in ops for a in op.accesses), dtype=bool)
    sizes = trace.storage_sizes
    sids = sorted_distinct(access_sid)
    size = np.fromiter((sizes.get(int(s), 0) for s in sids), dtype=np.int64, count=len(sids))
    duration = np.fromiter((op.duration_ms for op in ops), dtype=np.float64, count=n)
    return _arrays(trace, counts, access_sid, access_write, sids, size, duration)


def packed_trace_arrays(trace: ActivationTrace, packed: PackedTrace) -> TraceArrays:
    """``trace_arrays`` of a trace from its packed form (no per-access Python work)."""
    st = packed.structure
    counts = np.diff(np.array(st.access_start, dtype=np.int64))
    access_sid = np.array(st.access_sid, dtype=np.int64)
    access_write = np.frombuffer(st.access_write, dtype=np.uint8).astype(bool)
    sids = sorted_distinct(access_sid)
    known = np.array(packed.size_sid, dtype=np.int64)
    order = np.argsort(known, kind="stable")
    known, known_bytes = known[order], np.array(packed.size_bytes, dtype=np.int64)[order]
    where = np.minimum(np.searchsorted(known, sids), max(len(known) - 1, 0))
    size = (np.where(known[where] == sids, known_bytes[where], 0) if len(known)
            else np.zeros(len(sids), dtype=np.int64))
    return _arrays(trace, counts, access_sid, access_write, sids, size,
                   np.array(packed.duration_ms, dtype=np.float64))


def _arrays(trace: ActivationTrace, counts: np.ndarray, access_sid: np.ndarray, access_write: np.ndarray,
            sids: np.ndarray, size: np.ndarray, duration: np.ndarray) -> TraceArrays:
    n = len(counts)
    access_op = np.repeat(np.arange(n, dtype=np.int64), counts)
    dense = np.searchsorted(sids, access_sid)
    first_op = np.full(len(sids), n, dtype=np.int64)
    np.minimum.at(first_op, dense, access_op)
    last_op = np.full(len(sids), -1, dtype=np.int64)
    np.maximum.at(last_op, dense, access_op)
    end_op = last_op.copy()
    deaths = trace.death_ops
    if deaths and trace.tail_sids:  # a tail leaves the device at its last access
        deaths = {sid: op for sid, op in deaths.items() if sid not in trace.tail_sids}
    if deaths and len(sids):
        dead = np.array(sorted(deaths.items()), dtype=np.int64).reshape(-1, 2)
        where = np.searchsorted(sids, dead[:, 0])
        ok = where < len(sids)
        ok[ok] = sids[where[ok]] == dead[ok, 0]
        np.maximum.at(end_op, where[ok], np.minimum(dead[ok, 1], n - 1))
    reserve = None
    if trace.retained_sids and len(sids):
        retained = np.isin(sids, np.fromiter(trace.retained_sids, dtype=np.int64))
        end_op[retained] = n - 1
        if trace.reserve_retained:
            reserve = _not_yet_allocated(n, first_op[retained], size[retained])
    return TraceArrays(
        num_ops=n,
        access_op=access_op,
        access_sid=access_sid,
        access_write=access_write,
        access_size=size[dense] if len(sids) else np.zeros(0, dtype=np.int64),
        duration_ms=duration,
        sids=sids,
        first_op=first_op,
        last_op=last_op,
        end_op=end_op,
        size=size,
        pinned_sids=np.array(sorted(trace.pinned_sids), dtype=np.int64),
        reserve_bytes=reserve,
    )


def _not_yet_allocated(n: int, first_op: np.ndarray, size: np.ndarray) -> np.ndarray:
    """Per op, the bytes of the storages first accessed after it."""
    delta = np.zeros(n + 1, dtype=np.int64)
    delta[0] = int(size.sum())
    np.add.at(delta, np.minimum(first_op, n), -size)
    return np.cumsum(delta[:-1])


def with_reserve(resident: np.ndarray, arr: TraceArrays) -> np.ndarray:
    """``resident`` (bytes per op) with the budget's reserve for retained storages added."""
    return resident if arr.reserve_bytes is None else resident + arr.reserve_bytes


def with_reads(arr: TraceArrays, op: np.ndarray, sid: np.ndarray) -> TraceArrays:
    """``arr`` with reads no op makes: storage ``sid[i]`` must be on the device at op ``op[i]``
    (the fast path cannot free bytes Python holds, so a plan for it treats a held span as
    read). Reads outside a storage's life, of storages the trace never accesses, or where
    the op accesses the storage already are dropped (one access per storage and op)."""
    dense = np.searchsorted(arr.sids, sid)
    ok = dense < len(arr.sids)
    ok[ok] = arr.sids[dense[ok]] == sid[ok]
    ok[ok] = (op[ok] >= arr.first_op[dense[ok]]) & (op[ok] <= arr.end_op[dense[ok]])
    if not ok.any():
        return arr
    # one access per storage and op (as a trace has): none where the op touches it already
    n = len(arr.sids)
    key = np.unique(op[ok] * n + dense[ok])
    key = key[~np.isin(key, arr.access_op * n + np.searchsorted(arr.sids, arr.access_sid))]
    if not len(key):
        return arr
    op, dense = key // n, key % n
    sid = arr.sids[dense]
    access_op = np.concatenate([arr.access_op, op])
    order = np.argsort(access_op, kind="stable")  # the given reads after the op's own accesses
    last_op = arr.last_op.copy()
    np.maximum.at(last_op, dense, op)
    return replace(  # the per-storage and per-op fields it does not change carry over
        arr,
        access_op=access_op[order],
        access_sid=np.concatenate([arr.access_sid, sid])[order],
        access_write=np.concatenate([arr.access_write, np.zeros(len(op), dtype=bool)])[order],
        access_size=np.concatenate([arr.access_size, arr.size[dense]])[order],
        last_op=last_op,
        end_op=np.maximum(arr.end_op, last_op),
    )


def resident_without_offload(arr: TraceArrays) -> np.ndarray:
    """Bytes alive at each op (int64), as ``ActivationTrace.resident_bytes_without_offload``,
    plus the budget's reserve for retained storages (``reserve_bytes``) where there is one."""
    return with_reserve(_alive(arr, np.ones(len(arr.sids), dtype=bool)), arr)


def kept_and_movable_peak(arr: TraceArrays, retained_sids: frozenset[int]) -> tuple[int, int]:
    """The bytes a step keeps after it (retained: parameter gradients, the loss, outputs) and
    the peak of the rest, the bytes a plan can take off the device (its movable peak)."""
    movable = ~np.isin(arr.sids, np.fromiter(retained_sids, dtype=np.int64))
    resident = _alive(arr, movable)
    return int(arr.size[~movable].sum()), int(resident.max()) if len(resident) else 0


def _alive(arr: TraceArrays, which: np.ndarray) -> np.ndarray:
    """Bytes of the storages ``which`` (a mask) alive at each op, from first op to ``end_op``."""
    delta = np.zeros(arr.num_ops + 1, dtype=np.int64)
    np.add.at(delta, arr.first_op[which], arr.size[which])
    np.add.at(delta, arr.end_op[which] + 1, -arr.size[which])
    return np.cumsum(delta[:-1])


@dataclass(frozen=True)
class GapArrays:
    """Every candidate gap (see ``gaps.Gap``), unordered."""

    sid: np.ndarray
    start: np.ndarray
    end: np.ndarray
    copy_op: np.ndarray
    size: np.ndarray

    def __len__(self) -> int:
        return len(self.sid)


def gap_arrays(arr: TraceArrays) -> GapArrays:
    n = arr.num_ops
    order = np.lexsort((arr.access_op, arr.access_sid))
    sid = arr.access_sid[order]
    op = arr.access_op[order]
    write = arr.access_write[order]
    first_in_group = np.ones(len(sid), dtype=bool)
    first_in_group[1:] = sid[1:] != sid[:-1]
    group = np.cumsum(first_in_group) - 1
    # latest write at or before each access (the first access counts as one), per storage
    marker = np.where(write | first_in_group, op, -1) + group * (n + 1)
    latest_write = np.maximum.accumulate(marker) - group * (n + 1)
    same = ~first_in_group[1:]
    long_enough = (op[1:] - op[:-1]) >= 2
    pick = np.flatnonzero(same & long_enough)
    if len(arr.pinned_sids):
        pick = pick[~np.isin(sid[pick], arr.pinned_sids)]
    if arr.gap_boundary is not None:  # copied out (from the last write) in forward, back in backward
        pick = pick[(latest_write[pick] < arr.gap_boundary) & (op[pick + 1] >= arr.gap_boundary)]
    return GapArrays(
        sid=sid[pick],
        start=op[pick],
        end=op[pick + 1],
        copy_op=latest_write[pick],
        size=arr.access_size[order][pick],
    )
