"""A trace recorded op by op straight into the columns of a ``TraceStructure``.

Warmup appends each op here instead of making a ``TraceOp``, a ``StorageAccess`` per access
and an ``OpGuide``: at 300k ops those objects cost more to make than the op's own
bookkeeping, and planning then had to pack them into these very columns again.
"""

from __future__ import annotations

from array import array
from typing import Any

from hyperpar.offload.ir.guide import LeafMeta
from hyperpar.offload.ir.packed import TraceStructure
from hyperpar.offload.ir.trace import AccessKind

WRITE = AccessKind.WRITE


class TraceColumns:
    """Per op: name, key, accesses (recorded order), output bindings (by leaf), input sids
    and output meta; ``structure()`` is what ``pack_structure`` makes of the same ops."""

    __slots__ = ("_meta_ids", "access_sid", "access_start", "access_write", "bind_leaf", "bind_sid",
                 "bind_start", "input_sid", "input_start", "keys", "leaf_count", "meta_index", "names")

    def __init__(self) -> None:
        self.names: list[str] = []
        self.keys: list[Any] = []
        self.access_start, self.access_sid, self.access_write = array("q", [0]), array("q"), bytearray()
        self.leaf_count, self.meta_index = array("q"), array("q")
        self.bind_start, self.bind_leaf, self.bind_sid = array("q", [0]), array("q"), array("q")
        self.input_start, self.input_sid = array("q", [0]), array("q")
        self._meta_ids: dict[tuple[LeafMeta, ...], int] = {}

    def __len__(self) -> int:
        return len(self.names)

    def add(self, name: str, key: Any, kinds: dict[int, AccessKind], leaf_count: int,
            bindings: dict[int, int], meta: tuple[LeafMeta, ...], in_sids: tuple[int, ...]) -> None:
        """One op: ``kinds`` sid -> access in recorded order, ``bindings`` leaf -> new sid."""
        self.names.append(name)
        self.keys.append(key)
        sids = self.access_sid
        if kinds:
            sids.extend(kinds)
            self.access_write.extend([kind is WRITE for kind in kinds.values()])
        self.access_start.append(len(sids))
        self.leaf_count.append(leaf_count)
        if bindings:
            items = sorted(bindings.items()) if len(bindings) > 1 else bindings.items()
            for leaf, sid in items:
                self.bind_leaf.append(leaf)
                self.bind_sid.append(sid)
        self.bind_start.append(len(self.bind_sid))
        if in_sids:
            self.input_sid.extend(in_sids)
        self.input_start.append(len(self.input_sid))
        ids = self._meta_ids
        self.meta_index.append(ids.setdefault(meta, len(ids)))

    def structure(self) -> TraceStructure:
        return TraceStructure(
            names=tuple(self.names), access_start=self.access_start, access_sid=self.access_sid,
            access_write=bytes(self.access_write), has_guides=bool(self.names), guide_names=None,
            leaf_count=self.leaf_count, bind_start=self.bind_start, bind_leaf=self.bind_leaf,
            bind_sid=self.bind_sid, input_start=self.input_start, input_sid=self.input_sid,
            meta_index=self.meta_index, metas=tuple(self._meta_ids),
        )
