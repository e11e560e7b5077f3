"""The packed trace of a warmup that recorded columns: what ``recorded_trace`` makes of
objects, made with array operations (one pass per column instead of one per access)."""

from __future__ import annotations

from array import array
from typing import Any

import numpy as np

from hyperpar.offload.capture.ops.activation_table import ActivationTable
from hyperpar.offload.ir.packed import PackedTrace
from hyperpar.offload.ir.trace_columns import TraceColumns
from hyperpar.offload.runtime import OpTimer


def _q(a: np.ndarray) -> array:
    out = array("q")
    out.frombytes(np.ascontiguousarray(a, dtype=np.int64).tobytes())
    return out


def timed_durations(durations: list[float], timer: OpTimer | None, begin: array, end: array,
                    gaps_ms: Any) -> array:
    """Per op: its time plus the host gap before it, as ``recorded_trace`` computes it. On the
    host clock ``durations`` holds the ops' times; with device events the ops' marks give them
    (no gap: the device's time is what counts there); without a timer they are as measured."""
    if timer is None:
        return array("d", durations)
    if timer.use_events:
        times = np.array(timer.times_ms(), dtype=np.float64)
        ends, begins = np.frombuffer(end, dtype=np.int64), np.frombuffer(begin, dtype=np.int64)
        return array("d", np.maximum(times[ends] - times[begins], 0.0).tobytes())
    if not durations:
        return array("d")
    out = np.array(durations, dtype=np.float64) + np.array(gaps_ms[-len(durations):], dtype=np.float64)
    return array("d", out.tobytes())


def packed_recording(columns: TraceColumns, durations: array, table: ActivationTable, budget_bytes: int,
                     d2h_gbps: float, h2d_gbps: float) -> PackedTrace:
    """Sizes of every accessed storage (first-access order), the retained and pinned ones, and
    deaths later than a storage's last access (for a storage the step moved, maybe a little
    later than Python let go of it: a copy held it; planning makes tails of these anyway,
    see ``planning.tails``)."""
    structure = columns.structure()
    acc = np.frombuffer(structure.access_sid, dtype=np.int64)
    num_sids = table.num_sids
    accessed = np.zeros(num_sids, dtype=bool)
    last = np.full(num_sids, -1, dtype=np.int64)
    size_sid = np.zeros(0, dtype=np.int64)
    if len(acc):
        sids, first = np.unique(acc, return_index=True)
        size_sid = sids[np.argsort(first, kind="stable")]
        accessed[sids] = True
        op_of = np.repeat(np.arange(len(columns), dtype=np.int64),
                          np.diff(np.frombuffer(structure.access_start, dtype=np.int64)))
        _, from_end = np.unique(acc[::-1], return_index=True)
        last[sids] = op_of[len(acc) - 1 - from_end]
    nbytes = np.array(table.nbytes, dtype=np.int64)
    alive = np.array(table.ids, dtype=np.int64) != 0
    retained = frozenset(np.flatnonzero(alive & accessed).tolist())
    pinned = frozenset(s for s in table.pinned if s < num_sids and accessed[s])
    death_sid = np.fromiter(table.death.keys(), dtype=np.int64, count=len(table.death))
    death_op = np.fromiter(table.death.values(), dtype=np.int64, count=len(table.death))
    keep = accessed[death_sid] & (death_op > last[death_sid])
    return PackedTrace.recorded(
        structure, durations, _q(size_sid), _q(nbytes[size_sid]), retained, pinned,
        _q(death_sid[keep]), _q(death_op[keep]), budget_bytes, d2h_gbps, h2d_gbps)
