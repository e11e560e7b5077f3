"""An ActivationTrace packed into flat arrays: what a session keeps of a trace between steps.

The object form (a ``TraceOp``, a tuple of ``StorageAccess`` and an ``OpGuide`` per op) costs
several hundred bytes per access; a session keeps up to 16 plans per step structure, each
with its trace, so it keeps this form instead (about 40 bytes per access) and rebuilds the
objects only when they are asked for: ``OffloadSession.trace``, planning another size, or a
replay that diverged and takes the ops before the divergence. Plans of one structure differ
only in sizes and durations, so a trace packed ``like`` another shares its structure arrays.
"""

from __future__ import annotations

import weakref
from array import array
from dataclasses import dataclass

from hyperpar.offload.ir.guide import LeafMeta, OpGuide
from hyperpar.offload.ir.trace import AccessKind, ActivationTrace, StorageAccess, TraceOp

READ, WRITE = AccessKind.READ, AccessKind.WRITE


@dataclass(frozen=True)
class TraceStructure:
    """What does not depend on sizes: per op its name, accesses and guide, as flat columns.

    Per op ``i``: accesses ``access_*[access_start[i]:access_start[i+1]]`` (in recorded order),
    output bindings ``bind_*[bind_start[i]:bind_start[i+1]]`` (by leaf), tensor inputs
    ``input_sid[input_start[i]:input_start[i+1]]``, output meta ``metas[meta_index[i]]``.
    Equal (``==``, field by field) to another structure exactly when its columns are.
    """

    names: tuple[str, ...]
    access_start: array  # 'q', n + 1
    access_sid: array  # 'q'
    access_write: bytes  # 1 where the access is a WRITE
    has_guides: bool
    guide_names: tuple[str, ...] | None  # None: the ops' names
    leaf_count: array  # 'q'
    bind_start: array  # 'q', n + 1
    bind_leaf: array  # 'q'
    bind_sid: array  # 'q'
    input_start: array  # 'q', n + 1
    input_sid: array  # 'q' (NOT_ACTIVATION and NO_STORAGE are negative)
    meta_index: array  # 'q'
    metas: tuple[tuple[LeafMeta, ...], ...]  # each distinct output meta once

    @property
    def num_ops(self) -> int:
        return len(self.names)

    def accesses(self, i: int) -> list[tuple[int, bool]]:
        """(sid, is a write) of op ``i``'s accesses."""
        lo, hi = self.access_start[i], self.access_start[i + 1]
        return list(zip(self.access_sid[lo:hi], [w == 1 for w in self.access_write[lo:hi]], strict=True))

    def ops(self, durations: array, stop: int | None = None) -> list[TraceOp]:
        n = self.num_ops if stop is None else min(stop, self.num_ops)
        start, sids, writes = self.access_start, self.access_sid, self.access_write
        out = []
        for i in range(n):
            lo, hi = start[i], start[i + 1]
            out.append(TraceOp(self.names[i], durations[i], tuple(
                [StorageAccess(i, sids[k], WRITE if writes[k] else READ) for k in range(lo, hi)])))
        return out

    def guides(self, stop: int | None = None) -> list[OpGuide]:
        if not self.has_guides:
            return []
        n = self.num_ops if stop is None else min(stop, self.num_ops)
        names = self.guide_names if self.guide_names is not None else self.names
        bs, bl, bsid = self.bind_start, self.bind_leaf, self.bind_sid
        ins, isid = self.input_start, self.input_sid
        metas, mi, lc = self.metas, self.meta_index, self.leaf_count
        return [OpGuide(names[i], lc[i], {bl[k]: bsid[k] for k in range(bs[i], bs[i + 1])},
                        metas[mi[i]], tuple(isid[ins[i]:ins[i + 1]]))
                for i in range(n)]


def pack_structure(trace: ActivationTrace, like: TraceStructure | None = None,
                   durations: array | None = None) -> TraceStructure:
    """``like``: a structure to share when this trace's is the same; ``durations``: an array to
    append the ops' durations to on the way. One pass over the ops and one over the guides,
    with bound appends (the objects lie scattered over memory: a pass per column would fetch
    them again each time, and an append per access is cheaper than that)."""
    ops, guides, write = trace.ops, trace.guides, WRITE
    duration_add = (durations if durations is not None else array("d")).append
    access_start, access_sid, access_write = array("q", [0]), array("q"), bytearray()
    start_add, sid_add, write_add = access_start.append, access_sid.append, access_write.append
    k = 0
    names = []
    name_add = names.append
    for op in ops:
        name_add(op.name)
        duration_add(op.duration_ms)
        accesses = op.accesses
        for acc in accesses:
            sid_add(acc.storage_id)
            write_add(acc.kind is write)
        k += len(accesses)
        start_add(k)
    leaf_count, meta_index = array("q"), array("q")
    bind_start, bind_leaf, bind_sid = array("q", [0]), array("q"), array("q")
    input_start, input_sid = array("q", [0]), array("q")
    meta_ids: dict[tuple[LeafMeta, ...], int] = {}
    count_add, meta_add, add_meta = leaf_count.append, meta_index.append, meta_ids.setdefault
    bstart_add, leaf_add, bsid_add = bind_start.append, bind_leaf.append, bind_sid.append
    istart_add, isid_extend = input_start.append, input_sid.extend
    b = i = 0
    guide_names = []
    gname_add = guide_names.append
    for g in guides:
        gname_add(g.name)
        count_add(g.output_leaf_count)
        bindings = g.output_bindings
        if bindings:
            for leaf, sid in sorted(bindings.items()) if len(bindings) > 1 else bindings.items():
                leaf_add(leaf)
                bsid_add(sid)
            b += len(bindings)
        bstart_add(b)
        sids = g.input_sids
        if sids:
            isid_extend(sids)
            i += len(sids)
        istart_add(i)
        meta_add(add_meta(g.output_meta, len(meta_ids)))
    packed = TraceStructure(
        names=tuple(names), access_start=access_start, access_sid=access_sid,
        access_write=bytes(access_write), has_guides=bool(guides),
        guide_names=None if guide_names == names or not guides else tuple(guide_names),
        leaf_count=leaf_count, bind_start=bind_start, bind_leaf=bind_leaf, bind_sid=bind_sid,
        input_start=input_start, input_sid=input_sid, meta_index=meta_index, metas=tuple(meta_ids),
    )
    return like if like is not None and packed == like else packed


class PackedTrace:
    """A trace as a shared ``TraceStructure`` plus its own sizes, durations and sets."""

    __slots__ = ("__weakref__", "_unpacked", "d2h_bandwidth_gbps", "death_op", "death_sid", "duration_ms",
                 "h2d_bandwidth_gbps", "memory_limit_bytes", "pinned_sids", "reserve_retained",
                 "retained_sids", "size_bytes", "size_sid", "structure", "tail_sids")

    def __init__(self, trace: ActivationTrace, like: PackedTrace | None = None) -> None:
        self.duration_ms = array("d")
        self.structure = pack_structure(trace, None if like is None else like.structure, self.duration_ms)
        self.size_sid = array("q", trace.storage_sizes.keys())
        self.size_bytes = array("q", trace.storage_sizes.values())
        self.retained_sids = trace.retained_sids
        self.reserve_retained = trace.reserve_retained
        self.pinned_sids = trace.pinned_sids
        self.death_sid = array("q", trace.death_ops.keys())
        self.death_op = array("q", trace.death_ops.values())
        self.tail_sids = trace.tail_sids
        self.memory_limit_bytes = trace.memory_limit_bytes
        self.d2h_bandwidth_gbps = trace.d2h_bandwidth_gbps
        self.h2d_bandwidth_gbps = trace.h2d_bandwidth_gbps
        self._unpacked: weakref.ref[ActivationTrace] | None = weakref.ref(trace)

    @classmethod
    def recorded(cls, structure: TraceStructure, duration_ms: array, size_sid: array, size_bytes: array,
                 retained_sids: frozenset[int], pinned_sids: frozenset[int], death_sid: array,
                 death_op: array, memory_limit_bytes: int, d2h_bandwidth_gbps: float,
                 h2d_bandwidth_gbps: float) -> PackedTrace:
        """A trace recorded as columns (warmup): no object form exists until ``unpack``."""
        self = cls.__new__(cls)
        self.structure, self.duration_ms = structure, duration_ms
        self.size_sid, self.size_bytes = size_sid, size_bytes
        self.retained_sids, self.pinned_sids = retained_sids, pinned_sids
        self.reserve_retained = False  # the session decides (``ActivationTrace.reserve_retained``)
        self.death_sid, self.death_op = death_sid, death_op
        self.tail_sids: frozenset[int] = frozenset()  # a recording marks none (planning does)
        self.memory_limit_bytes = memory_limit_bytes
        self.d2h_bandwidth_gbps, self.h2d_bandwidth_gbps = d2h_bandwidth_gbps, h2d_bandwidth_gbps
        self._unpacked = None
        return self

    @property
    def num_ops(self) -> int:
        return self.structure.num_ops

    def storage_sizes(self) -> dict[int, int]:
        return dict(zip(self.size_sid, self.size_bytes, strict=True))

    def size_of(self, sid: int, default: int = 0) -> int:
        sids = self.size_sid
        if sids and sids[0] == sid:  # sid 0 is nearly always the first one recorded
            return self.size_bytes[0]
        try:
            return self.size_bytes[sids.index(sid)]
        except ValueError:
            return default

    def ops(self, stop: int | None = None) -> list[TraceOp]:
        """Fresh ``TraceOp`` objects for ops ``0 .. stop-1`` (all by default)."""
        return self.structure.ops(self.duration_ms, stop)

    def guides(self, stop: int | None = None) -> list[OpGuide]:
        return self.structure.guides(stop)

    def unpack(self) -> ActivationTrace:
        """The trace as objects; the same object while someone still holds the last one."""
        trace = None if self._unpacked is None else self._unpacked()
        if trace is None:
            trace = ActivationTrace(
                ops=self.ops(), storage_sizes=self.storage_sizes(), retained_sids=self.retained_sids,
                memory_limit_bytes=self.memory_limit_bytes, d2h_bandwidth_gbps=self.d2h_bandwidth_gbps,
                h2d_bandwidth_gbps=self.h2d_bandwidth_gbps, guides=self.guides(),
                pinned_sids=self.pinned_sids,
                death_ops=dict(zip(self.death_sid, self.death_op, strict=True)),
                tail_sids=self.tail_sids, reserve_retained=self.reserve_retained,
            )
            self._unpacked = weakref.ref(trace)
        return trace
