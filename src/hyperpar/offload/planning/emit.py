"""Turn chosen gaps into per-op actions, the same way for every planner.

Per storage, in op order: COPY_D2H after the gap's copy op unless the host copy is
still current (no write since the previous D2H), RELEASE_DEVICE after the gap start,
COPY_H2D before ``h2d_op`` (the consumer, or earlier for a prefetch); after the last
access RELEASE_DEVICE (unless retained) and RELEASE_HOST if it was ever copied out. A tail
(``ActivationTrace.tail_sids``: Python holds it past its last access) is copied out after
its last write, so that release can take it off the device (the host copy stays while
Python holds the storage).
Each post list holds D2H copies, then releases, then host releases; each kind by sid.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

import numpy as np

from hyperpar.offload.ir import ActivationTrace, ResidencySchedule
from hyperpar.offload.ir import ResidencyActionType as Act
from hyperpar.offload.ir.packed_schedule import KINDS, PackedActionsSchedule
from hyperpar.offload.planning.arrays import TraceArrays, trace_arrays
from hyperpar.offload.planning.gaps import Gap


def emit_schedule(
    trace: ActivationTrace,
    chosen: Sequence[Gap],
    planner: str,
    h2d_ops: Sequence[int] | None = None,
    arrays: TraceArrays | None = None,
) -> ResidencySchedule:
    """``h2d_ops[k]`` is the op whose pre list issues the H2D of ``chosen[k]`` (default: its end).

    Laid out as packed arrays by one sort (a 300k-op step has an action or more per storage);
    the schedule makes its action objects only if someone asks for them."""
    arr = arrays if arrays is not None else trace_arrays(trace)
    n = trace.num_ops
    count = len(chosen)
    sid = np.fromiter((g.sid for g in chosen), dtype=np.int64, count=count)
    start = np.fromiter((g.start for g in chosen), dtype=np.int64, count=count)
    end = np.fromiter((g.end for g in chosen), dtype=np.int64, count=count)
    copy_op = np.fromiter((g.copy_op for g in chosen), dtype=np.int64, count=count)
    issue = end if h2d_ops is None else np.asarray(h2d_ops, dtype=np.int64).reshape(count)
    t_sid, t_last, t_copy = _tails(trace, arr)
    c_sid, c_start, c_op = (np.concatenate([sid, t_sid]), np.concatenate([start, t_last]),
                            np.concatenate([copy_op, t_copy]))
    # one D2H per run of a storage's gaps (by start) sharing a copy op: the host copy is current
    by_sid = np.lexsort((c_start, c_sid))
    s_sid, s_copy = c_sid[by_sid], c_op[by_sid]
    new_copy = np.ones(len(s_sid), dtype=bool)
    new_copy[1:] = (s_sid[1:] != s_sid[:-1]) | (s_copy[1:] != s_copy[:-1])
    keep_last = np.ones(len(arr.sids), dtype=bool)
    if trace.retained_sids and len(arr.sids):
        keep_last = ~np.isin(arr.sids, np.fromiter(trace.retained_sids, dtype=np.int64))
    moved = np.isin(arr.sids, c_sid)
    # rows: (list index, key within the list, sid, kind); post lists hold D2H copies, then
    # releases of gaps, then final releases, then host releases; pre lists H2D by consumer
    groups = (
        (2 * s_copy[new_copy] + 1, 0, s_sid[new_copy], Act.COPY_D2H),
        (2 * start + 1, 1, sid, Act.RELEASE_DEVICE),
        (2 * arr.end_op[keep_last] + 1, 2, arr.sids[keep_last], Act.RELEASE_DEVICE),
        (2 * arr.last_op[moved] + 1, 3, arr.sids[moved], Act.RELEASE_HOST),
        (2 * issue, end, sid, Act.COPY_H2D),
    )
    lists = np.concatenate([g[0] for g in groups])
    key = np.concatenate([np.broadcast_to(np.asarray(g[1], dtype=np.int64), g[0].shape) for g in groups])
    sids = np.concatenate([g[2] for g in groups])
    kinds = np.concatenate([np.full(len(g[0]), KINDS.index(g[3]), dtype=np.uint8) for g in groups])
    order = np.lexsort((sids, key, lists))
    offsets = array("q", [0])
    offsets.frombytes(np.cumsum(np.bincount(lists, minlength=2 * n)[:2 * n], dtype=np.int64).tobytes())
    return PackedActionsSchedule(packed=(offsets, kinds[order].tobytes(), _q(sids[order])), planner=planner,
                                 budget_bytes=trace.memory_limit_bytes)


def _tails(trace: ActivationTrace, arr: TraceArrays) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The tails to copy out: sid, last access, copy op (the last write, or the first access
    of a storage that is only read: its data exists from there)."""
    if not trace.tail_sids or not len(arr.sids):
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty, empty
    tails = np.fromiter(trace.tail_sids - trace.retained_sids, dtype=np.int64)
    d = np.flatnonzero(np.isin(arr.sids, tails) & ~np.isin(arr.sids, arr.pinned_sids))
    t_sid = arr.sids[d]
    copy = arr.first_op[d].copy()
    written = arr.access_write & np.isin(arr.access_sid, t_sid)
    np.maximum.at(copy, np.searchsorted(t_sid, arr.access_sid[written]), arr.access_op[written])
    return t_sid, arr.last_op[d], copy


def _q(values: np.ndarray) -> array:
    out = array("q")
    out.frombytes(np.ascontiguousarray(values, dtype=np.int64).tobytes())
    return out


def as_gaps(starts: np.ndarray, ends: np.ndarray, copy_ops: np.ndarray, sids: np.ndarray,
            sizes: np.ndarray) -> list[Gap]:
    return [
        Gap(s, a, b, c, z)
        for s, a, b, c, z in zip(sids.tolist(), starts.tolist(), ends.tolist(), copy_ops.tolist(),
                                 sizes.tolist(), strict=True)
    ]
