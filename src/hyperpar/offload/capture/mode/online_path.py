"""The online path: warmup's algorithm, and a diverged replay's from the op it left its plan.

Before an op its input activations are paged in if evicted and protected; while the
resident activation bytes exceed the budget, the storage made by the oldest op (largest
first among one op's outputs) that is resident, unprotected and not pinned goes to host;
the op runs; new output storages are bound; with ``recording`` the op is appended to the
trace. Warmup runs every op this way, and so does a replay from the op where it diverged,
which keeps every step within its budget and turns a diverged step into a trace of its own.
``ExecutorBase`` adds the op entry point and opaque regions on top.
"""

from __future__ import annotations

import heapq
import time
import weakref
from collections.abc import Collection
from typing import Any

import torch

from hyperpar.offload.capture.ops.activation_table import ActivationTable
from hyperpar.offload.capture.ops.op_args import output_leaves, tensor_inputs, written_tensors
from hyperpar.offload.capture.ops.op_identity import COLLECTIVE, DTYPE_NAMES, dtype_name, op_kind, op_name
from hyperpar.offload.capture.ops.output_bytes import predicted_bytes
from hyperpar.offload.ir import AccessKind, OpGuide, StorageAccess, TraceOp
from hyperpar.offload.ir.guide import NO_STORAGE, NOT_ACTIVATION
from hyperpar.offload.runtime import OpTimer, ResidencyManager

READ, WRITE = AccessKind.READ, AccessKind.WRITE
Tensor = torch.Tensor
_STRIDED = torch.strided
_heappush = heapq.heappush


def _neg_bytes(item: tuple[int, Any, int, Any]) -> int:
    return -item[0]


class OpState:
    """One op of the online path between its start and its end."""

    __slots__ = ("in_bytes", "in_ids", "in_sids", "index", "key", "kinds", "name", "pin", "start_event",
                 "t0")

    def __init__(self, index: int, key: Any, name: str, kinds: dict[int, AccessKind],
                 in_ids: Collection[int], in_sids: tuple[int, ...], pin: bool, in_bytes: int = 0) -> None:
        self.index, self.key, self.name, self.kinds = index, key, name, kinds
        self.in_ids, self.in_sids, self.pin, self.in_bytes = in_ids, in_sids, pin, in_bytes
        self.t0 = 0.0
        self.start_event: torch.Event | None = None


class OnlinePath:
    """Online residency of one step: the activation table, eviction order, budget keeping."""

    def __init__(self, manager: ResidencyManager, device: torch.device, budget_bytes: int) -> None:
        self.manager = manager
        self.device = device
        self.budget_bytes = budget_bytes
        self.table = ActivationTable(self)
        self.timer: OpTimer | None = None  # op boundaries (warmup: durations; replay: timeline)
        self.op_marks: list[tuple[str, int, int]] = []  # (name, begin mark, end mark)
        self.index = 0  # ops of this step so far (opaque regions count as one)
        self.peak_bytes = 0
        self.peak_op: int | None = None
        # The online path: a trace of the step when ``recording``.
        self.recording = False
        self.ops: list[TraceOp] = []
        self.guides: list[OpGuide] = []
        self.keys: list[Any] = []  # OpOverload, or the opaque region's name
        self._plain: dict[int, weakref.ref] = {}  # storages first seen as inputs: not activations
        self._heap: list[tuple[int, int, int]] = []  # (producer op, -bytes, sid): eviction order
        # id(op) -> most bytes it made per input byte (by id: an OpOverload hashes in Python);
        # ``_ratio_keys`` holds those ops, so that each id stays its op's.
        self._out_ratio: dict[int, float] = {}
        self._ratio_keys: list[Any] = []
        self._gaps_ms: list[float] = []  # host time between the previous op's return and this op
        self._last_exit = time.perf_counter()
        # On an accelerator without a timer an op is timed by events (the device's own time).
        self._events = device.type != "cpu" and torch.accelerator.is_available()
        self._current = "-"

    def resident_bytes(self) -> int:
        """Activation bytes of this step on the device now (measured the same in every phase)."""
        return self.table.live_bytes - self.manager.away_bytes + self.manager.pending_bytes

    def note_peak(self, op: int) -> None:
        resident = self.resident_bytes()
        if resident > self.peak_bytes:
            self.peak_bytes, self.peak_op = resident, op

    def online_op(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        self._gaps_ms.append((time.perf_counter() - self._last_exit) * 1e3)
        state = self.online_begin(func, op_name(func), tensor_inputs(args, kwargs),
                                  written_tensors(func, args, kwargs), op_kind(func) == COLLECTIVE,
                                  predicted_bytes(func, args, kwargs, self.device))
        out = func(*args, **kwargs)
        self.online_end(state, output_leaves(out))
        self._last_exit = time.perf_counter()
        return out

    def classify_inputs(self, inputs: list[Tensor], written: list[Tensor], pin: bool,
                        ) -> tuple[dict[int, AccessKind], set[int], tuple[int, ...], bool]:
        """(sid -> access kind, ids of the input storages, sid per input, whether to pin)."""
        table = self.table
        kinds: dict[int, AccessKind] = {}
        in_ids: set[int] = set()
        in_sids: list[int] = []
        plain = self._plain
        for t in inputs:
            try:
                st = t.untyped_storage()
            except (RuntimeError, NotImplementedError):  # sparse and other storage-less layouts
                in_sids.append(NO_STORAGE)
                pin = True
                continue
            in_ids.add(id(st))
            sid = table.lookup(st)
            if sid is None:
                in_sids.append(NOT_ACTIVATION)
                plain[id(st)] = weakref.ref(st)
            else:
                in_sids.append(sid)
                kinds.setdefault(sid, READ)
        for t in written:
            try:
                sid = table.lookup(t.untyped_storage())
            except (RuntimeError, NotImplementedError):
                continue
            if sid is not None:
                kinds[sid] = WRITE
        return kinds, in_ids, tuple(in_sids), pin

    def online_begin(self, key: Any, name: str, inputs: list[Tensor], written: list[Tensor],
                     pin: bool, made: int | None = None) -> OpState:
        m = self.manager
        if m.pending_free:
            m.reap()
        kinds, in_ids, in_sids, pin = self.classify_inputs(inputs, written, pin)
        self._bring_in(kinds)
        if pin:
            self.pin_sids(kinds)
        in_bytes = sum(t.nbytes for t in inputs if t.layout is _STRIDED)
        # Room for what the op is about to allocate: ``made`` where its arguments say
        # (``output_bytes``), else as much as it made per input byte before (a view op makes
        # nothing; another op, at first, as much as it reads).
        if made is None:
            ratio = self._out_ratio.get(id(key))
            if ratio is None:
                ratio = 0.0 if getattr(key, "is_view", False) else 1.0
            made = int(ratio * in_bytes)
        self.enforce_budget(kinds, target=self.budget_bytes - made)
        return self._start(OpState(self.index, key, name, kinds, in_ids, in_sids, pin, in_bytes))

    def _start(self, state: OpState) -> OpState:
        self.index += 1
        self._current = state.name
        if self.timer is not None:  # events on an accelerator, read once at the end of the step
            state.t0 = self.timer.mark()
        elif self._events:
            state.start_event = torch.Event(device=self.device, enable_timing=True)
            state.start_event.record()
        else:
            state.t0 = time.perf_counter()
        return state

    def _bring_in(self, kinds: dict[int, AccessKind]) -> None:
        """Inputs back on the device (demand faults), and no copy out still reading a storage
        the op writes."""
        m = self.manager
        entries, inflight = m.entries, m.inflight
        for sid, kind in kinds.items():
            entry = entries.get(sid)
            if entry is None:
                continue
            if not entry.resident or inflight.get(entry.key) is entry:
                m.copy_h2d(entry, demand=True)
                if sid not in self.table.pinned:
                    heapq.heappush(self._heap, (self.table.producer[sid], -entry.nbytes, sid))
            if kind is WRITE and entry.d2h_event is not None:
                m.wait_d2h(entry)

    def online_end(self, state: OpState, leaves: list[Any]) -> None:
        duration_ms = self._op_duration(state)
        i, kinds = state.index, state.kinds
        meta, bindings, pin, fresh, _ = self.bind_outputs(state.key, i, kinds, state.in_ids, state.in_bytes,
                                                          leaves)
        if pin or state.pin:
            self.pin_sids(kinds)
        self.refresh_written(kinds, fresh)
        self.note_peak(i)
        if self.recording:
            self.record_op(state, duration_ms, kinds, len(leaves), bindings, meta)

    def bind_outputs(self, key: Any, i: int, kinds: dict[int, AccessKind], in_ids: Collection[int],
                     in_bytes: int, leaves: list[Any],
                     ) -> tuple[tuple[Any, ...], dict[int, int], bool, int, bool]:
        """Op ``i``'s outputs: new storages bound to new sids (largest first), older activations
        among them marked written in ``kinds``. Returns (output meta, leaf -> sid bindings,
        whether to pin, the first new sid, whether an older activation came out)."""
        table = self.table
        sid_of, plain = table.sid_of, self._plain
        dev = self.device
        meta: list[Any] = []
        new: list[tuple[int, torch.UntypedStorage, int, Tensor]] = []  # (bytes, storage, leaf, tensor)
        bindings: dict[int, int] = {}
        pin = rewritten = False
        for li, leaf in enumerate(leaves):
            if not isinstance(leaf, Tensor):
                meta.append(None)
                continue
            dtype = leaf.dtype
            meta.append((tuple(leaf.shape), DTYPE_NAMES.get(dtype) or dtype_name(dtype)))
            try:
                st = leaf.untyped_storage()
            except (RuntimeError, NotImplementedError):
                pin = True
                continue
            st_id = id(st)
            if st_id in in_ids:
                continue
            sid = sid_of.get(st_id)
            if sid is not None:
                kinds[sid] = WRITE
                rewritten = True
                if table.producer[sid] == i and li not in bindings:  # bound by a replay of this op
                    bindings[li] = sid
                continue
            p = plain.get(st_id)
            if (p is not None and p() is st) or st.device != dev:  # a fake tensor: meta
                continue
            nbytes = st.nbytes()
            if nbytes and (not new or all(s is not st for _, s, _, _ in new)):
                new.append((nbytes, st, li, leaf))
        fresh = len(table.ids)
        if new:
            if len(new) > 1:
                new.sort(key=_neg_bytes)
                made = sum(x[0] for x in new)
            else:
                made = new[0][0]
            if in_bytes and made / in_bytes > self._out_ratio.get(id(key), 0.0):
                self.raise_out_ratio(key, made / in_bytes)
            heap = self._heap
            for nbytes, st, li, leaf in new:
                sid = table.bind_new(st, nbytes, i)
                bindings[li] = sid
                kinds[sid] = WRITE
                # Every reader of a strided, plain (not quantized, not nested) tensor's storage
                # goes through the dispatcher: it may move; any other stays.
                if leaf.layout is _STRIDED and not leaf.is_quantized and not leaf.is_nested:
                    _heappush(heap, (i, -nbytes, sid))
                else:
                    table.pinned.add(sid)
        return tuple(meta), bindings, pin, fresh, rewritten

    def raise_out_ratio(self, key: Any, made: float) -> None:
        """Op ``key`` made ``made`` bytes per input byte, more than before: budget for that much
        next time (the check stays at the call site, where it is one lookup an op)."""
        kid = id(key)
        if kid not in self._out_ratio:
            self._ratio_keys.append(key)  # the id stays this op's while the executor lives
        self._out_ratio[kid] = made

    def refresh_written(self, kinds: dict[int, AccessKind], fresh: int) -> None:
        """Storages the op wrote: host copies are stale, and ``out=`` may have resized them
        (sids from ``fresh`` on are new: nothing to refresh)."""
        m = self.manager
        entries = m.entries
        for sid, kind in kinds.items():
            if kind is WRITE and sid < fresh:
                entry = entries.get(sid)
                if entry is not None:
                    m.mark_written(entry)
                self._refresh_size(sid)

    def record_op(self, state: OpState, duration_ms: float, kinds: dict[int, AccessKind], leaf_count: int,
                  bindings: dict[int, int], meta: tuple[Any, ...]) -> None:
        """Append one op to the trace as objects (warmup records columns instead)."""
        i = state.index
        self.ops.append(TraceOp(state.name, duration_ms, tuple(
            [StorageAccess(i, sid, kind) for sid, kind in kinds.items()])))
        self.guides.append(OpGuide(state.name, leaf_count, bindings, meta, state.in_sids))
        self.keys.append(state.key)

    def _op_duration(self, state: OpState) -> float:
        if self.timer is not None:
            self.op_marks.append((state.name, int(state.t0), self.timer.mark()))
            return 0.0  # filled in from the timer's marks by build_trace
        if state.start_event is not None:
            end = torch.Event(device=self.device, enable_timing=True)
            end.record()
            end.synchronize()
            return state.start_event.elapsed_time(end)
        return (time.perf_counter() - state.t0) * 1e3

    def _refresh_size(self, sid: int) -> None:
        """An op with ``out=`` may have resized an existing storage."""
        table = self.table
        st = table.storage(sid)
        if st is None:
            return
        entry = self.manager.entries.get(sid)
        if entry is not None and not entry.resident:
            return
        nbytes = st.nbytes()
        if nbytes != table.nbytes[sid]:
            table.resize(sid, nbytes)
            if entry is not None:
                self.manager.resident_bytes += nbytes - entry.nbytes
                entry.nbytes = nbytes

    def enforce_budget(self, protected: Any, target: int | None = None) -> None:
        """Evict the oldest resident activations until ``target`` (default: the budget) holds,
        or nothing is left to evict; ``protected`` sids stay. Releases count as done when
        issued; if their copies leave the device over ``target``, wait for the oldest."""
        m, table, heap = self.manager, self.table, self._heap
        limit = self.budget_bytes if target is None else target
        if self.resident_bytes() <= limit:
            return
        skipped = []
        entries, pinned = m.entries, table.pinned
        while table.live_bytes - m.away_bytes > limit and heap:
            item = heapq.heappop(heap)
            sid = item[2]
            if sid in pinned:
                continue
            entry = entries.get(sid)
            if entry is not None and (not entry.resident or not entry.evictable):
                continue
            st = table.storage(sid)
            if st is None:
                continue
            if sid in protected:
                skipped.append(item)
                continue
            if st.nbytes() != table.nbytes[sid]:  # resized behind our back: someone else's memory
                table.pinned.add(sid)
                continue
            if entry is None:
                entry = m.bind(sid, st, producer_op=table.producer[sid])
            if not (m.copy_d2h(entry) and m.release_device(entry)):
                entry.evictable = False  # host pool at its cap, or a non-resizable storage
        for item in skipped:
            heapq.heappush(heap, item)
        over = self.resident_bytes() - limit
        if over > 0 and m.pending_bytes:  # releases whose copies still read their bytes: wait
            m.free_pending_until(over)

    def pin_sids(self, sids: Any) -> None:
        """These storages stay on the device for the rest of the step (paged in first)."""
        m, pinned = self.manager, self.table.pinned
        for sid in sids:
            pinned.add(sid)
            entry = m.entries.get(sid)
            if entry is not None:
                if not entry.resident or entry.free_pending or entry.h2d_event is not None:
                    m.copy_h2d(entry, demand=True)
                entry.evictable = False

    def start_online(self) -> None:
        """From now on every op takes the online path (a diverged replay calls this)."""
        m, table = self.manager, self.table
        heap = []
        for sid in table.alive():
            if sid in table.pinned:
                continue
            entry = m.entries.get(sid)
            if entry is None or entry.resident:
                heap.append((table.producer[sid], -table.nbytes[sid], sid))
        heapq.heapify(heap)
        self._heap = heap
