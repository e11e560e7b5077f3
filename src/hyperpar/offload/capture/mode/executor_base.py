"""What warmup and replay share: the op entry point and opaque regions, over the online path.

The online path (warmup's budget keeping, and a diverged replay's) is ``online_path``'s.

Pinned storages never leave the device for the rest of the step: buffers of c10d and
functional collectives (their bytes are read and written after the op returns), strided
storages an op shares with a sparse or otherwise storage-less tensor (kernels reach them
without going through the dispatcher), and storages Python reads behind the dispatcher
(``.numpy()``, ``.tolist()``, ``torch.save``; see ``host_reads``).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from hyperpar.offload.capture.mode.online_path import OnlinePath, OpState
from hyperpar.offload.capture.ops.activation_table import live_ids, read_ids
from hyperpar.offload.capture.ops.op_args import tensor_inputs, written_tensors
from hyperpar.offload.capture.ops.op_identity import COLLECTIVE, op_kind
from hyperpar.offload.ir import AccessKind
from hyperpar.offload.ir.report import StepReport
from hyperpar.offload.runtime import ResidencyManager, StepTimeline
from hyperpar.offload.runtime.copy_engine import CopySpan

READ, WRITE = AccessKind.READ, AccessKind.WRITE
Tensor = torch.Tensor


class ExecutorBase(OnlinePath):
    phase = "base"

    def __init__(self, manager: ResidencyManager, device: torch.device, budget_bytes: int) -> None:
        super().__init__(manager, device, budget_bytes)
        self.opaque_depth = 0  # > 0 inside skip_offload: ops run untraced
        self.passthrough = 0  # > 0 while our own copies run: ops run untouched
        self.closed = False
        self.regions: list[OpState] = []  # open opaque regions of the online path, innermost last
        self.region_graphs: list[Any] = []  # autograd nodes of this step's regions (see opaque)

    # --- entry point ----------------------------------------------------------------
    def dispatch(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                 kwargs: dict[str, Any] | None = None) -> Any:
        """The dispatch mode's ``__torch_dispatch__``."""
        if kwargs is None:
            kwargs = {}
        if self.passthrough:
            return func(*args, **kwargs)
        if self.opaque_depth:
            self.untraced_op(func, args, kwargs)
            return func(*args, **kwargs)
        return self.run_op(func, args, kwargs)

    def release_region_graphs(self) -> None:
        """Drop our references to region nodes (they would keep a forward-only graph alive)."""
        for graph in self.region_graphs:
            graph.nodes = ()
        self.region_graphs = []

    def describe_op(self) -> str:
        """Names the op now running, for error messages."""
        return f"at op {max(self.index - 1, 0)} ({self._current})"

    # --- opaque regions -------------------------------------------------------------
    def untraced_op(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """An op inside a skip_offload region: not traced, but its activations are accesses of
        the region's op (so the plan keeps them), a 0-byte (evicted) storage never reaches a
        kernel, and a write makes any host copy stale."""
        region = self.regions[-1] if self.regions else None
        kinds, _, _, pin = self.classify_inputs(
            tensor_inputs(args, kwargs), written_tensors(func, args, kwargs),
            op_kind(func) == COLLECTIVE)
        self._bring_in(kinds)
        if pin:
            self.pin_sids(kinds)
            if region is not None:
                region.pin = True
        m = self.manager
        for sid, kind in kinds.items():
            if kind is WRITE:
                entry = m.entries.get(sid)
                if entry is not None:
                    m.mark_written(entry)
        if region is not None:
            rk = region.kinds
            for sid, kind in kinds.items():
                if kind is WRITE:
                    rk[sid] = WRITE
                else:
                    rk.setdefault(sid, READ)
        self.after_untraced(kinds)

    def after_untraced(self, kinds: dict[int, AccessKind]) -> None:
        """Hook: replay checks the region's accesses against the plan."""

    def begin_opaque(self, name: str, reads: list[torch.UntypedStorage]) -> Any:
        """Start a skip_offload region as one op reading ``reads``; returns a token."""
        raise NotImplementedError

    def end_opaque(self, token: Any, outputs: list[Tensor]) -> None:
        raise NotImplementedError

    def online_begin_opaque(self, name: str, reads: list[torch.UntypedStorage]) -> OpState:
        self._gaps_ms.append((time.perf_counter() - self._last_exit) * 1e3)
        m = self.manager
        if m.pending_free:
            m.reap()
        kinds: dict[int, AccessKind] = {}
        for st in reads:
            sid = self.table.lookup(st)
            if sid is not None:
                kinds.setdefault(sid, READ)
        self._bring_in(kinds)
        self.enforce_budget(kinds)
        state = self._start(OpState(self.index, name, name, kinds, read_ids(reads), (), False))
        self.regions.append(state)
        return state

    def online_end_opaque(self, state: OpState, outputs: list[Tensor]) -> None:
        if state in self.regions:
            self.regions.remove(state)
        if isinstance(state.in_ids, dict):  # a read that died inside may share an output's id
            state.in_ids = live_ids(state.in_ids)
        self.online_end(state, list(outputs))
        self._last_exit = time.perf_counter()

    # --- reads behind the dispatcher -------------------------------------------------
    def read_behind_dispatcher(self, storage: torch.UntypedStorage) -> None:
        """Python is about to read this storage's bytes without an op: bring it back and keep it.
        What it gets may be written too (``.numpy()`` on CPU): a copy out still reading the
        storage finishes first, so no write of the user's races it."""
        sid = self.table.lookup(storage)
        if sid is not None:
            with _Raised(self, "passthrough"):
                self.pin_sids((sid,))
                self.manager.finish_copies_of([storage])

    # --- end of step ----------------------------------------------------------------
    def timeline(self, copies: list[CopySpan]) -> StepTimeline:
        """The step's ops (from the timer's marks) with the engine's copies."""
        timer = self.timer
        times = timer.times_ms() if timer is not None else []
        ops = [(name, times[b], times[e]) for name, b, e in self.op_marks if e < len(times)]
        clock = "device" if timer is not None and timer.use_events else "host"
        return StepTimeline(ops=ops, copies=list(copies), clock=clock)

    def run_op(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        raise NotImplementedError

    def report(self, step_ms: float, **extra: Any) -> StepReport:
        m = self.manager
        write_ms, read_ms = m.disk_ms()
        return StepReport(
            phase=self.phase, op_count=self.index, peak_resident_bytes=self.peak_bytes,
            budget_bytes=self.budget_bytes, bytes_d2h=m.bytes_d2h, bytes_h2d=m.bytes_h2d,
            demand_faults=m.demand_faults, step_ms=step_ms,
            overshoot_bytes=max(self.peak_bytes - self.budget_bytes, 0),
            overshoot_op=self.peak_op if self.peak_bytes > self.budget_bytes else None,
            offload_cap_hits=m.cap_hits, bytes_to_disk=m.bytes_to_disk, bytes_from_disk=m.bytes_from_disk,
            peak_host_bytes=m.peak_host_bytes, disk_write_ms=write_ms, disk_read_ms=read_ms, **extra,
        )

    def finish(self, clean: bool, step_ms: float) -> tuple[StepReport, Exception | None]:
        """Page every live storage back in; returns the report and an error to raise, if any."""
        self.closed = True
        self.release_region_graphs()
        with internal(self):
            self.manager.restore_all()
        return self.report(step_ms), None


class _Raised:
    """Raise one of the executor's depth counters for a block: ``passthrough`` (ops run
    untouched while the executor does its own bookkeeping) or ``opaque_depth`` (ops run
    untraced inside a region)."""

    __slots__ = ("counter", "ex")

    def __init__(self, ex: ExecutorBase, counter: str) -> None:
        self.ex, self.counter = ex, counter

    def __enter__(self) -> None:
        setattr(self.ex, self.counter, getattr(self.ex, self.counter) + 1)

    def __exit__(self, *exc: object) -> None:
        setattr(self.ex, self.counter, getattr(self.ex, self.counter) - 1)


def internal(ex: ExecutorBase) -> _Raised:
    return _Raised(ex, "passthrough")


def untraced(ex: ExecutorBase) -> _Raised:
    return _Raised(ex, "opaque_depth")

