"""An ``ActivationTrace`` over a ``PackedTrace`` whose op and guide objects are made on demand.

Planning a warmup's trace reads it through arrays (``planning.arrays``), the op count and at
most a few single ops (the floor names one), so the view makes no objects for that; a planner
that iterates the ops gets them all, built once.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar, overload

from hyperpar.offload.ir.guide import OpGuide
from hyperpar.offload.ir.packed import PackedTrace, TraceStructure
from hyperpar.offload.ir.trace import ActivationTrace, StorageAccess, TraceOp

T = TypeVar("T")


class LazyList(Sequence[T]):
    """``len`` and single items without building the rest; anything else builds the list once."""

    __slots__ = ("_build", "_items", "_length", "_one")

    def __init__(self, length: int, one: Callable[[int], T], build: Callable[[], list[T]]) -> None:
        self._length, self._one, self._build = length, one, build
        self._items: list[T] | None = None

    def items(self) -> list[T]:
        if self._items is None:
            self._items = self._build()
        return self._items

    def __len__(self) -> int:
        return self._length

    @overload
    def __getitem__(self, i: int) -> T: ...

    @overload
    def __getitem__(self, i: slice) -> list[T]: ...

    def __getitem__(self, i: Any) -> Any:
        if self._items is None and isinstance(i, int):
            if i < 0:
                i += self._length
            if not 0 <= i < self._length:
                raise IndexError("trace index out of range")
            return self._one(i)
        return self.items()[i]

    def __iter__(self) -> Iterator[T]:
        return iter(self.items())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, LazyList):
            other = other.items()
        return self.items() == other

    __hash__ = None  # type: ignore[assignment]  # like a list

    def __repr__(self) -> str:
        return repr(self.items())


def trace_view(packed: PackedTrace) -> ActivationTrace:
    """The trace ``packed`` holds, for planning: ops and guides are lazy (see ``LazyList``)."""
    st = packed.structure
    n = st.num_ops

    def op(i: int) -> TraceOp:
        return TraceOp(st.names[i], packed.duration_ms[i],
                       tuple([StorageAccess(i, sid, kind) for sid, kind in st.accesses(i)]))

    return ActivationTrace(
        ops=LazyList(n, op, packed.ops),  # type: ignore[arg-type]
        storage_sizes=packed.storage_sizes(), retained_sids=packed.retained_sids,
        memory_limit_bytes=packed.memory_limit_bytes, d2h_bandwidth_gbps=packed.d2h_bandwidth_gbps,
        h2d_bandwidth_gbps=packed.h2d_bandwidth_gbps,
        guides=LazyList(n if st.has_guides else 0, lambda i: _guide(st, i), packed.guides),  # type: ignore[arg-type]
        pinned_sids=packed.pinned_sids, death_ops=dict(zip(packed.death_sid, packed.death_op, strict=True)),
        tail_sids=packed.tail_sids, reserve_retained=packed.reserve_retained,
    )


def _guide(st: TraceStructure, i: int) -> OpGuide:
    names = st.guide_names if st.guide_names is not None else st.names
    bs, ins = st.bind_start, st.input_start
    return OpGuide(names[i], st.leaf_count[i],
                   {st.bind_leaf[k]: st.bind_sid[k] for k in range(bs[i], bs[i + 1])},
                   st.metas[st.meta_index[i]], tuple(st.input_sid[ins[i]:ins[i + 1]]))
