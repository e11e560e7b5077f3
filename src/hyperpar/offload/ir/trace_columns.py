"""A trace recorded op by op straight into the columns of a ``TraceStructure``.

Warmup appends each op here instead of making a ``TraceOp``, a ``StorageAccess`` per access
and an ``OpGuide``: at 300k ops those objects cost more to make than the op's own
bookkeeping, and planning then had to pack them into these very columns again.

The columns grow as lists and become arrays once, in ``structure()``: an ``array('q')``
parses every item it takes (``PyArg_Parse``, some 200 instructions), a list only keeps a
pointer, the same 8 bytes (sids are the ints the activation table holds anyway, counts are
small ints Python shares). The five numbers every op has go in as one ``extend``.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from typing import Any

import numpy as np

from hyperpar.offload.ir.guide import LeafMeta
from hyperpar.offload.ir.packed import TraceStructure
from hyperpar.offload.ir.trace import AccessKind

WRITE = AccessKind.WRITE
_PER_OP = 5  # accesses, leaf count, bindings, inputs, meta index
_RUN = 64
_READS_WRITES = bytes(_RUN) + b"\x01" * _RUN  # [_RUN - r:_RUN + w]: r reads, then w writes


def _int64(items: list[int]) -> array:
    out = array("q")
    out.frombytes(np.array(items, dtype=np.int64).tobytes())
    return out


class TraceColumns:
    """Per op: name, key, accesses (recorded order), output bindings (by leaf), input sids
    and output meta; ``structure()`` is what ``pack_structure`` makes of the same ops."""

    __slots__ = ("_meta_ids", "_per_op", "access_sid", "access_write", "bind_leaf", "bind_sid", "input_sid",
                 "keys", "names")

    def __init__(self) -> None:
        self.names: list[str] = []
        self.keys: list[Any] = []
        self.access_sid: list[int] = []
        self.access_write = bytearray()
        self.bind_leaf: list[int] = []
        self.bind_sid: list[int] = []
        self.input_sid: list[int] = []
        self._per_op: list[int] = []
        self._meta_ids: dict[tuple[LeafMeta, ...], int] = {}

    def __len__(self) -> int:
        return len(self.names)

    def add(self, name: str, key: Any, kinds: dict[int, AccessKind], leaf_count: int,
            bindings: dict[int, int], meta: tuple[LeafMeta, ...], in_sids: Sequence[int],
            reads: int = -1) -> None:
        """One op: ``kinds`` sid -> access in recorded order, ``bindings`` leaf -> new sid.
        ``reads`` >= 0: the first ``reads`` accesses read and the rest write (the fused path
        knows it), so the kinds need not be looked at."""
        self.names.append(name)
        self.keys.append(key)
        accesses = len(kinds)
        if accesses:
            self.access_sid.extend(kinds)
            writes = accesses - reads
            if reads < 0 or reads > _RUN or writes > _RUN:
                self.access_write.extend([kind is WRITE for kind in kinds.values()])
            else:
                self.access_write.extend(_READS_WRITES[_RUN - reads:_RUN + writes])
        if bindings:
            if len(bindings) > 1:
                for leaf, sid in sorted(bindings.items()):
                    self.bind_leaf.append(leaf)
                    self.bind_sid.append(sid)
            else:
                self.bind_leaf.extend(bindings)
                self.bind_sid.extend(bindings.values())
        if in_sids:
            self.input_sid.extend(in_sids)
        ids = self._meta_ids
        meta_index = ids.setdefault(meta, len(ids))
        self._per_op.extend((accesses, leaf_count, len(bindings), len(in_sids), meta_index))

    def add_one(self, name: str, key: Any, kinds: dict[int, AccessKind], reads: int, in_sids: Sequence[int],
                meta: tuple[LeafMeta, ...], bound: int) -> None:
        """``add`` for an op with one output leaf, bound to sid ``bound`` unless it is -1, whose
        first ``reads`` accesses read and the rest write."""
        self.names.append(name)
        self.keys.append(key)
        accesses = len(kinds)
        if accesses:
            self.access_sid.extend(kinds)
            if reads <= _RUN and accesses - reads <= _RUN:
                self.access_write.extend(_READS_WRITES[_RUN - reads:_RUN + accesses - reads])
            else:
                self.access_write.extend([kind is WRITE for kind in kinds.values()])
        if bound >= 0:
            self.bind_leaf.append(0)
            self.bind_sid.append(bound)
        self.input_sid.extend(in_sids)
        ids = self._meta_ids
        meta_index = ids.setdefault(meta, len(ids))
        self._per_op.extend((accesses, 1, bound >= 0, len(in_sids), meta_index))

    def structure(self) -> TraceStructure:
        per_op = np.array(self._per_op, dtype=np.int64).reshape(-1, _PER_OP)

        def column(k: int) -> array:
            out = array("q")
            out.frombytes(per_op[:, k].tobytes())
            return out

        def starts(k: int) -> array:
            out = array("q", [0])
            out.frombytes(np.cumsum(per_op[:, k]).tobytes())
            return out

        return TraceStructure(
            names=tuple(self.names), access_start=starts(0), access_sid=_int64(self.access_sid),
            access_write=bytes(self.access_write), has_guides=bool(self.names), guide_names=None,
            leaf_count=column(1), bind_start=starts(2), bind_leaf=_int64(self.bind_leaf),
            bind_sid=_int64(self.bind_sid), input_start=starts(3), input_sid=_int64(self.input_sid),
            meta_index=column(4), metas=tuple(self._meta_ids),
        )
