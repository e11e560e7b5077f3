"""Warmup: run the step once, record what every op touched, keep under budget online.

Before each op its input activations are protected and paged in if evicted; then, while
the resident activation bytes exceed the budget, the storage produced by the oldest op
(largest first among one op's outputs) that is resident and unprotected goes to host.
When nothing is left to evict the overshoot is recorded, never raised.
"""

from __future__ import annotations

import heapq
import time
import weakref
from typing import Any

import torch

from hyperpar.offload.capture.executor_base import ExecutorBase
from hyperpar.offload.capture.op_args import output_leaves, storage_of, tensor_inputs, written_tensors
from hyperpar.offload.ir import AccessKind, ActivationTrace, OpGuide, StorageAccess, TraceOp
from hyperpar.offload.ir.report import StepReport
from hyperpar.offload.runtime import ResidencyManager

READ, WRITE = AccessKind.READ, AccessKind.WRITE
_NAMES: dict[Any, str] = {}


def op_name(func: Any) -> str:
    name = _NAMES.get(func)
    if name is None:
        name = _NAMES[func] = str(func)
    return name


class _OpState:
    __slots__ = ("in_keys", "index", "key", "kinds", "name", "start_event", "t0")

    def __init__(self, index: int, key: Any, name: str, kinds: dict[int, AccessKind],
                 in_keys: set[int]) -> None:
        self.index, self.key, self.name, self.kinds, self.in_keys = index, key, name, kinds, in_keys
        self.t0 = 0.0
        self.start_event: torch.Event | None = None


class WarmupExecutor(ExecutorBase):
    phase = "warmup"

    def __init__(self, manager: ResidencyManager, device: torch.device, budget_bytes: int) -> None:
        super().__init__(manager, device, budget_bytes)
        self.ops: list[TraceOp] = []
        self.guides: list[OpGuide] = []
        self.keys: list[Any] = []  # OpOverload, or the opaque region's name
        self.storage_sizes: dict[int, int] = {}
        self._plain: dict[int, weakref.ref] = {}  # storages first seen as inputs: not activations
        self._heap: list[tuple[int, int, int]] = []  # (producer op, -bytes, sid)
        # On an accelerator an op is timed by events on its stream (the device's own time, not
        # the launch); the host waits for each op here, which the async runtime will remove.
        self._events = device.type != "cpu" and torch.accelerator.is_available()
        self.peak_bytes = 0
        self.peak_op: int | None = None
        self._regions: list[_OpState] = []  # open skip_offload regions, innermost last
        self._current = "-"
        self._gaps_ms: list[float] = []  # host time between the previous op's return and this op
        self._last_exit = time.perf_counter()

    def describe_op(self) -> str:
        return f"at op {len(self.ops)} ({self._current})"

    # --- ops ------------------------------------------------------------------------
    def run_op(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        self._gaps_ms.append((time.perf_counter() - self._last_exit) * 1e3)
        reads = self.device_storages(tensor_inputs(args, kwargs))
        writes = self.device_storages(written_tensors(func, args, kwargs))
        state = self._begin(func, op_name(func), reads, writes)
        out = func(*args, **kwargs)
        self._end(state, output_leaves(out))
        self._last_exit = time.perf_counter()
        return out

    def begin_opaque(self, name: str, reads: list[torch.UntypedStorage]) -> _OpState:
        self._gaps_ms.append((time.perf_counter() - self._last_exit) * 1e3)
        state = self._begin(name, name, reads, [])
        self._regions.append(state)
        return state

    def end_opaque(self, token: _OpState, outputs: list[torch.Tensor]) -> None:
        if self._regions and self._regions[-1] is token:
            self._regions.pop()
        self._end(token, list(outputs))
        self._last_exit = time.perf_counter()

    def untraced_op(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Activations a region reads or writes without taking them as arguments (a captured
        mask, a rotary cache) are accesses of the region's op, so the plan keeps them."""
        if not self._regions:
            super().untraced_op(func, args, kwargs)
            return
        state, m = self._regions[-1], self.manager
        for st in self.device_storages(tensor_inputs(args, kwargs)):
            entry = m.lookup(st)
            if entry is None:
                continue
            state.kinds.setdefault(entry.sid, READ)
            state.in_keys.add(st._cdata)
            if not entry.resident:
                m.copy_h2d(entry, demand=True)
                heapq.heappush(self._heap, (entry.producer_op, -entry.nbytes, entry.sid))
        for st in self.device_storages(written_tensors(func, args, kwargs)):
            entry = m.lookup(st)
            if entry is not None:
                state.kinds[entry.sid] = WRITE

    def _begin(self, key: Any, name: str, reads: list[torch.UntypedStorage],
               writes: list[torch.UntypedStorage]) -> _OpState:
        m = self.manager
        if m.pending_free:
            m.reap()
        kinds: dict[int, AccessKind] = {}
        in_keys: set[int] = set()
        for st in reads:
            in_keys.add(st._cdata)
            entry = m.lookup(st)
            if entry is not None:
                kinds.setdefault(entry.sid, READ)
            else:
                self._plain[st._cdata] = weakref.ref(st)
        for st in writes:
            entry = m.lookup(st)
            if entry is not None:
                kinds[entry.sid] = WRITE
        for sid in kinds:
            entry = m.entries[sid]
            if not entry.resident:
                m.copy_h2d(entry, demand=True)
                heapq.heappush(self._heap, (entry.producer_op, -entry.nbytes, sid))
        self._enforce_budget(kinds)
        state = _OpState(len(self.ops), key, name, kinds, in_keys)
        self._current = name
        if self.timer is not None:  # events on an accelerator, read once at the end of the step
            state.t0 = self.timer.mark()
            return state
        if self._events:
            state.start_event = torch.Event(device=self.device, enable_timing=True)
            state.start_event.record()
        state.t0 = time.perf_counter()
        return state

    def _end(self, state: _OpState, leaves: list[Any]) -> None:
        if self.timer is not None:
            self.op_marks.append((state.name, int(state.t0), self.timer.mark()))
            duration_ms = 0.0  # filled in from the timer's marks by build_trace
        elif state.start_event is not None:
            end = torch.Event(device=self.device, enable_timing=True)
            end.record()
            end.synchronize()
            duration_ms = state.start_event.elapsed_time(end)
        else:
            duration_ms = (time.perf_counter() - state.t0) * 1e3
        m, dev, i, kinds = self.manager, self.device, state.index, state.kinds
        meta: list[Any] = []
        new: list[tuple[int, torch.UntypedStorage, int]] = []  # (bytes, storage, leaf)
        for li, leaf in enumerate(leaves):
            if not isinstance(leaf, torch.Tensor):
                meta.append(None)
                continue
            meta.append((tuple(leaf.shape), str(leaf.dtype)))
            if leaf.device != dev:
                continue
            st = storage_of(leaf)
            if st is None or st._cdata in state.in_keys:
                continue
            entry = m.lookup(st)
            if entry is not None:
                kinds[entry.sid] = WRITE
                continue
            plain = self._plain.get(st._cdata)
            if plain is not None and plain() is st:
                continue
            nbytes = st.nbytes()
            if nbytes and not any(s is st for _, s, _ in new):
                new.append((nbytes, st, li))
        bindings: dict[int, int] = {}
        new.sort(key=lambda x: -x[0])
        for nbytes, st, li in new:
            sid = len(self.storage_sizes)
            m.bind(sid, st, producer_op=i)
            self.storage_sizes[sid] = nbytes
            bindings[li] = sid
            kinds[sid] = WRITE
            heapq.heappush(self._heap, (i, -nbytes, sid))
        for sid, kind in kinds.items():
            entry = m.entries.get(sid)
            if kind is WRITE and entry is not None:
                m.mark_written(entry)
                self._refresh_size(entry)
        if m.resident_bytes > self.peak_bytes:
            self.peak_bytes, self.peak_op = m.resident_bytes, i
        self.ops.append(TraceOp(state.name, duration_ms,
                                tuple(StorageAccess(i, sid, kind) for sid, kind in kinds.items())))
        self.guides.append(OpGuide(state.name, len(leaves), bindings, tuple(meta)))
        self.keys.append(state.key)

    def _refresh_size(self, entry: Any) -> None:
        """An op with ``out=`` may have resized an existing storage."""
        st = entry.ref()
        if st is None or not entry.resident:
            return
        nbytes = st.nbytes()
        if nbytes != entry.nbytes:
            self.manager.resident_bytes += nbytes - entry.nbytes
            entry.nbytes = nbytes
            self.storage_sizes[entry.sid] = max(self.storage_sizes[entry.sid], nbytes)

    def _enforce_budget(self, protected: dict[int, AccessKind]) -> None:
        m, heap = self.manager, self._heap
        if m.resident_bytes <= self.budget_bytes:
            return
        skipped = []
        while m.resident_bytes > self.budget_bytes and heap:
            item = heapq.heappop(heap)
            entry = m.entries.get(item[2])
            if entry is None or not entry.resident or not entry.evictable:
                continue
            if item[2] in protected:
                skipped.append(item)
                continue
            if not (m.copy_d2h(entry) and m.release_device(entry)):
                entry.evictable = False  # host pool at its cap, or a non-resizable storage
        for item in skipped:
            heapq.heappush(heap, item)

    # --- end of step ----------------------------------------------------------------
    def finish(self, clean: bool, step_ms: float) -> tuple[StepReport, Exception | None]:
        self.closed = True
        m = self.manager
        m.restore_all()
        report = StepReport(
            phase="warmup", op_count=len(self.ops), peak_resident_bytes=self.peak_bytes,
            budget_bytes=self.budget_bytes, bytes_d2h=m.bytes_d2h, bytes_h2d=m.bytes_h2d,
            demand_faults=m.demand_faults, step_ms=step_ms,
            overshoot_bytes=max(self.peak_bytes - self.budget_bytes, 0),
            overshoot_op=self.peak_op if self.peak_bytes > self.budget_bytes else None,
            offload_cap_hits=m.cap_hits,
        )
        return report, None

    def build_trace(self, d2h_gbps: float, h2d_gbps: float) -> ActivationTrace:
        """Call after finish(): storages still bound are alive, hence retained."""
        retained = frozenset(sid for sid, e in self.manager.entries.items() if e.ref() is not None)
        if self.timer is not None:
            times = self.timer.times_ms()
            gaps = self._gaps_ms if not self.timer.use_events else [0.0] * len(self.ops)
            for op, (_, begin, end), gap in zip(self.ops, self.op_marks, gaps, strict=True):
                op.duration_ms = max(times[end] - times[begin], 0.0) + gap
        return ActivationTrace(
            ops=self.ops, storage_sizes=dict(self.storage_sizes), retained_sids=retained,
            memory_limit_bytes=self.budget_bytes, d2h_bandwidth_gbps=d2h_gbps,
            h2d_bandwidth_gbps=h2d_gbps, guides=self.guides,
        )
