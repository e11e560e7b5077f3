"""Warmup: run the step once on the online path, recording what every op touched.

The budget is kept online (see ``executor_base``); when nothing is left to evict the
overshoot is recorded, never raised. Ops are recorded as columns (``TraceColumns``), and the
common op (a plain aten op that mutates no argument and takes its tensors positionally, all
of them with a storage) takes a fused copy of the online path: the same decisions in one
frame (its one tensor output bound there too, most ops' case), with the rare cases (budget
pressure, pages to bring back, pins, outputs that are older activations) handed to the
shared methods. Per tiny op that path costs about 74k CPU instructions against 14k for the
op without a session and 43k under a do-nothing dispatch mode
(``benchmarks/warmup_instructions.py``).
"""

from __future__ import annotations

import heapq
import time
import weakref
from array import array
from typing import Any

import torch
from torch._ops import OpOverload

from hyperpar.offload.capture.mode.executor_base import ExecutorBase
from hyperpar.offload.capture.mode.online_path import OpState
from hyperpar.offload.capture.ops.op_args import mutates, nested_tensors, output_leaves
from hyperpar.offload.capture.ops.op_identity import DTYPE_NAMES, PLAIN, dtype_name, op_kind, op_name
from hyperpar.offload.capture.ops.output_bytes import PREDICT_ERRORS, PREDICTORS
from hyperpar.offload.capture.tracing.recorded_packed import packed_recording, timed_durations
from hyperpar.offload.ir import AccessKind, ActivationTrace
from hyperpar.offload.ir.guide import NOT_ACTIVATION
from hyperpar.offload.ir.packed import PackedTrace
from hyperpar.offload.ir.packed_view import trace_view
from hyperpar.offload.ir.trace_columns import TraceColumns
from hyperpar.offload.runtime import ResidencyManager

__all__ = ["WarmupExecutor", "op_name"]

READ, WRITE = AccessKind.READ, AccessKind.WRITE
Tensor = torch.Tensor
_STRIDED = torch.strided
_perf_counter = time.perf_counter
_ref = weakref.ref
_heappush = heapq.heappush
_OVERLOAD_CALL = OpOverload.__call__


class _Fused:
    """What the fused path needs to know of an op, found with one lookup by ``id(func)`` (an
    OpOverload hashes in Python, a call of its own at every dict lookup)."""

    __slots__ = ("call", "func", "name", "predict", "ratio")

    def __init__(self, func: Any) -> None:
        self.func = func  # held: the id stays this op's
        fused = (isinstance(func, OpOverload) and op_kind(func) == PLAIN and not mutates(func)
                 and not nested_tensors(func))
        self.name = op_name(func) if fused else ""  # "": the op takes ``online_op``
        self.ratio = 0.0 if getattr(func, "is_view", False) else 1.0  # bytes made per byte read, at first
        self.predict = PREDICTORS.get(func)  # exact bytes made, for ops whose arguments say
        # What OpOverload.__call__ calls (one Python frame less), where the class keeps that call.
        self.call = func._op if fused and type(func).__call__ is _OVERLOAD_CALL else func


_FUSED: dict[int, _Fused] = {}


def _fused(func: Any) -> _Fused:
    op = _FUSED[id(func)] = _Fused(func)
    return op


class WarmupExecutor(ExecutorBase):
    phase = "warmup"

    def __init__(self, manager: ResidencyManager, device: torch.device, budget_bytes: int) -> None:
        super().__init__(manager, device, budget_bytes)
        self.recording = True
        self.columns = TraceColumns()
        self.keys = self.columns.keys
        # Per op in recorded order: its time on the host clock (0.0 for one timed by device
        # events, whose marks give it at the end of the step).
        self.durations: list[float] = []
        self._marks_begin, self._marks_end = array("q"), array("q")

    def record_op(self, state: OpState, duration_ms: float, kinds: dict[int, AccessKind], leaf_count: int,
                  bindings: dict[int, int], meta: tuple[Any, ...]) -> None:
        self.columns.add(state.name, state.key, kinds, leaf_count, bindings, meta, state.in_sids)
        self.durations.append(duration_ms)

    def _op_duration(self, state: OpState) -> float:
        timer = self.timer
        if timer is None:
            return super()._op_duration(state)
        marks = timer.host_marks
        if marks is not None:  # the host clock: the op is done, its time is known now
            return (_perf_counter() - marks[int(state.t0)]) * 1e3
        self._marks_begin.append(int(state.t0))
        self._marks_end.append(timer.mark())
        return 0.0

    def run_op(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """``online_op`` fused for the common op (see the module docstring)."""
        entered = _perf_counter()
        fid = id(func)
        op = _FUSED.get(fid)
        if op is None:
            op = _fused(func)
        name = op.name
        m, timer = self.manager, self.timer
        if not name or m.pending_free or timer is None:
            return self.online_op(func, args, kwargs)
        table = self.table
        sid_of, plain = table.sid_of, self._plain
        kinds: dict[int, AccessKind] = {}
        in_sids: list[int] = []
        in_bytes = 0
        for t in args:
            if not isinstance(t, Tensor):
                continue
            try:
                st = t.untyped_storage()
            except (RuntimeError, NotImplementedError):  # no storage: the op pins, online_op knows how
                return self.online_op(func, args, kwargs)
            key = id(st)
            sid = sid_of.get(key)
            if sid is not None:
                in_sids.append(sid)
                if sid not in kinds:
                    kinds[sid] = READ
            else:
                in_sids.append(NOT_ACTIVATION)
                p = plain.get(key)
                if p is None or p() is not st:  # a parameter is seen again every step: its ref stays
                    plain[key] = _ref(st)
            if t.layout is _STRIDED:
                in_bytes += t.nbytes
        reads = len(kinds)
        if reads and m.entries:
            self._bring_in(kinds)
        made = None
        if op.predict is not None:  # ``predict_or_none``, inline
            try:
                made = op.predict(args, kwargs, self.device)
            except PREDICT_ERRORS:
                pass
        if made is None:
            ratio = self._out_ratio.get(fid)
            if ratio is None:
                ratio = op.ratio
            made = int(ratio * in_bytes)
        target = self.budget_bytes - made
        if table.live_bytes - m.away_bytes + m.pending_bytes > target:
            self.enforce_budget(kinds, target=target)
        self._gaps_ms.append((entered - self._last_exit) * 1e3)
        i = self.index
        self.index = i + 1
        self._current = name
        if timer.host_marks is not None:  # the host clock: no marks, the time now
            begin = _perf_counter()
            out = op.call(*args, **kwargs)
            self.durations.append((_perf_counter() - begin) * 1e3)
        else:
            self._marks_begin.append(timer.mark())
            out = op.call(*args, **kwargs)
            self._marks_end.append(timer.mark())
            self.durations.append(0.0)
        if out.__class__ is not Tensor and not isinstance(out, Tensor):
            leaves = output_leaves(out)
            in_ids = [id(t.untyped_storage()) for t in args if isinstance(t, Tensor)]
            meta, bindings, pin, fresh, rewritten = self.bind_outputs(func, i, kinds, in_ids, in_bytes,
                                                                      leaves)
            if pin:
                self.pin_sids(kinds)
            if rewritten:  # no input is written (see ``_Fused``): only an older activation that came out
                self.refresh_written(kinds, fresh)
            self.note_peak(i)
            self.columns.add(name, func, kinds, len(leaves), bindings, meta, in_sids, reads)
            self._last_exit = _perf_counter()
            return out
        # One tensor output: ``bind_outputs`` and the rest of the op here, without the lists and
        # dicts that several outputs need (and without a call: this is most ops). ``kinds``
        # holds just the inputs here, so an output storage with a sid in it is an input's (a
        # view) and one in ``_plain`` is an input's or a parameter's: neither is new.
        dtype = out.dtype
        meta = ((tuple(out.shape), DTYPE_NAMES.get(dtype) or dtype_name(dtype)),)
        bound = -1
        try:
            st = out.untyped_storage()
        except (RuntimeError, NotImplementedError):
            self.pin_sids(kinds)
        else:
            st_id = id(st)
            sid = sid_of.get(st_id)
            if sid is not None:
                if sid not in kinds:  # an older activation came out: written
                    kinds[sid] = WRITE
                    self.refresh_written(kinds, len(table.ids))
            else:
                p = plain.get(st_id)
                if (p is None or p() is not st) and st.device == self.device:  # else: a fake tensor's, meta
                    nbytes = st.nbytes()
                    if nbytes:
                        if in_bytes and nbytes / in_bytes > self._out_ratio.get(fid, 0.0):
                            self.raise_out_ratio(func, nbytes / in_bytes)
                        bound = table.bind_new(st, nbytes, i)
                        kinds[bound] = WRITE
                        if out.layout is _STRIDED and not out.is_quantized and not out.is_nested:
                            _heappush(self._heap, (i, -nbytes, bound))
                        else:  # see ``bind_outputs``
                            table.pinned.add(bound)
        resident = table.live_bytes - m.away_bytes + m.pending_bytes
        if resident > self.peak_bytes:
            self.peak_bytes, self.peak_op = resident, i
        self.columns.add_one(name, func, kinds, reads, in_sids, meta, bound)
        self._last_exit = _perf_counter()
        return out

    def begin_opaque(self, name: str, reads: list[torch.UntypedStorage]) -> OpState:
        return self.online_begin_opaque(name, reads)

    def end_opaque(self, token: OpState, outputs: list[torch.Tensor]) -> None:
        self.online_end_opaque(token, outputs)

    def build_trace(self, d2h_gbps: float, h2d_gbps: float) -> ActivationTrace:
        """Call after finish(): storages still alive are retained. Ops and guides are made
        on demand (``trace_view``)."""
        return trace_view(self.build_packed(d2h_gbps, h2d_gbps))

    def build_packed(self, d2h_gbps: float, h2d_gbps: float) -> PackedTrace:
        """The recorded trace, packed (no op objects are made)."""
        durations = timed_durations(self.durations, self.timer, self._marks_begin, self._marks_end,
                                    self._gaps_ms)
        return packed_recording(self.columns, durations, self.table, self.budget_bytes, d2h_gbps, h2d_gbps)


def recorded_trace(ex: ExecutorBase, d2h_gbps: float, h2d_gbps: float, first_timed: int) -> ActivationTrace:
    """The trace an executor recorded on its online path; ops before ``first_timed`` keep the
    durations they came with (a diverged replay's prefix, taken from its plan)."""
    table = ex.table
    timer = ex.timer
    if timer is not None and ex.op_marks:
        times = timer.times_ms()
        timed = ex.ops[first_timed:]
        gaps = ex._gaps_ms if not timer.use_events else [0.0] * len(timed)
        for op, (_, begin, end), gap in zip(timed, ex.op_marks[-len(timed):], gaps[-len(timed):],
                                            strict=True):
            op.duration_ms = max(times[end] - times[begin], 0.0) + gap
    sizes: dict[int, int] = {}
    for op in ex.ops:
        for acc in op.accesses:
            sizes[acc.storage_id] = max(sizes.get(acc.storage_id, 0), table.nbytes[acc.storage_id])
    retained = frozenset(sid for sid in table.alive() if sid in sizes)
    last: dict[int, int] = {}
    for i, op in enumerate(ex.ops):
        for acc in op.accesses:
            last[acc.storage_id] = i
    # When Python let go of a storage (see ``packed_recording``).
    deaths = {sid: op for sid, op in table.death.items() if sid in last and op > last[sid]}
    return ActivationTrace(
        ops=ex.ops, storage_sizes=sizes, retained_sids=retained,
        memory_limit_bytes=ex.budget_bytes, d2h_bandwidth_gbps=d2h_gbps,
        h2d_bandwidth_gbps=h2d_gbps, guides=ex.guides,
        pinned_sids=frozenset(s for s in table.pinned if s in sizes),
        death_ops=deaths,
    )
