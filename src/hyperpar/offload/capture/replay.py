"""Replay: run the planned actions around each op, check the step still matches the trace.

On the first mismatch (op, output count, shapes or dtypes, or too many / too few ops)
the rest of the step runs in safe mode: no scheduled action any more, demand paging
keeps every read correct, and the session re-traces at its next entry; with
``on_divergence="raise"`` an OffloadDivergenceError names the op instead.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from hyperpar.offload.capture.errors import OffloadDivergenceError
from hyperpar.offload.capture.executor_base import ExecutorBase
from hyperpar.offload.capture.op_args import output_leaves, tensor_inputs, written_tensors
from hyperpar.offload.capture.replay_program import (
    D2H,
    H2D,
    RELEASE,
    RELEASE_FINAL,
    Actions,
    ReplayProgram,
)
from hyperpar.offload.capture.warmup import op_name
from hyperpar.offload.ir.report import StepReport
from hyperpar.offload.runtime import ResidencyManager

logger = logging.getLogger(__name__)
Tensor = torch.Tensor


def _describe(leaves: list[Any] | tuple[Any, ...]) -> str:
    parts = []
    for leaf in leaves:
        if isinstance(leaf, Tensor):
            parts.append(f"{tuple(leaf.shape)}:{str(leaf.dtype).removeprefix('torch.')}")
        elif isinstance(leaf, tuple) and len(leaf) == 2 and isinstance(leaf[1], torch.dtype):
            parts.append(f"{tuple(leaf[0])}:{str(leaf[1]).removeprefix('torch.')}")
        else:
            parts.append("-")
    return "[" + ", ".join(parts) + "]"


class ReplayExecutor(ExecutorBase):
    phase = "replay"

    def __init__(self, manager: ResidencyManager, device: torch.device, budget_bytes: int,
                 program: ReplayProgram, on_divergence: str) -> None:
        super().__init__(manager, device, budget_bytes)
        self.program = program
        self.index = 0
        self.safe = False
        self.diverged_at: int | None = None
        self.peak_bytes = 0
        self.peak_op: int | None = None
        self._n = program.num_ops
        self._raise = on_divergence == "raise"
        self._opaque_marks: list[int] = []

    # --- ops (the hot path) ---------------------------------------------------------
    def run_op(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        i = self.index
        self.index = i + 1
        p = self.program
        if self.safe or i >= self._n or func is not p.keys[i]:
            if not self.safe:
                self._diverge(i, op_name(func), None)
            return self._run_safe(func, args, kwargs)
        pre = p.pre[i]
        if pre is not None:
            self._act(pre)
        m = self.manager
        if m.pending_free:
            m.reap()
        if m.evicted or m.inflight:
            m.page_in_inputs(tensor_inputs(args, kwargs))
        writes = p.writes[i]
        if writes is not None:
            self._before_writes(writes)
        timer = self.timer
        if timer is None:
            out = func(*args, **kwargs)
        else:
            begin = timer.mark()
            out = func(*args, **kwargs)
            self.op_marks.append((p.names[i], begin, timer.mark()))
        if type(out) is Tensor:
            meta = p.meta[i]
            m0 = meta[0] if len(meta) == 1 else None
            if m0 is None or out.dtype is not m0[1] or out.shape != m0[0]:
                self._diverge(i, op_name(func), [out])
                return out
            self._after(i, None, out)
        else:
            leaves = output_leaves(out)
            if not self._meta_matches(p.meta[i], leaves):
                self._diverge(i, op_name(func), leaves)
                return out
            self._after(i, leaves, out)
        return out

    def _run_safe(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        m = self.manager
        if m.pending_free:
            m.reap()
        if m.evicted or m.inflight:
            m.page_in_inputs(tensor_inputs(args, kwargs))
        if m.pending_d2h_writes_possible():
            m.wait_d2h_of(self.device_storages(written_tensors(func, args, kwargs)))
        return func(*args, **kwargs)

    def _before_writes(self, writes: tuple[int, ...]) -> None:
        """An op writing a storage waits for its copy out to have read the old bytes."""
        m = self.manager
        entries = m.entries
        for sid in writes:
            entry = entries.get(sid)
            if entry is not None and entry.d2h_event is not None:
                m.wait_d2h(entry)

    def describe_op(self) -> str:
        i = self.index - 1
        name = self.program.names[i] if 0 <= i < self._n else "-"
        return f"at op {i} ({name})"

    def _after(self, i: int, leaves: list[Any] | None, out: Any) -> None:
        p, m = self.program, self.manager
        binds = p.binds[i]
        if binds is not None:
            if leaves is None:
                leaves = [out]
            for leaf, sid in binds:
                m.bind(sid, leaves[leaf].untyped_storage(), i)
        writes = p.writes[i]
        if writes is not None:
            entries = m.entries
            for sid in writes:
                entry = entries.get(sid)
                if entry is not None:
                    entry.host_current = False
        resident = p.base_resident[i] - m.offloaded_bytes
        if resident > self.peak_bytes:
            self.peak_bytes, self.peak_op = resident, i
        post = p.post[i]
        if post is not None:
            self._act(post)

    @staticmethod
    def _meta_matches(meta: tuple[Any, ...], leaves: list[Any]) -> bool:
        if len(meta) != len(leaves):
            return False
        for m, leaf in zip(meta, leaves, strict=True):
            if m is None:
                if isinstance(leaf, Tensor):
                    return False
            elif not isinstance(leaf, Tensor) or leaf.dtype is not m[1] or leaf.shape != m[0]:
                return False
        return True

    def _act(self, actions: Actions) -> None:
        m = self.manager
        entries = m.entries
        for code, sid in actions:  # type: ignore[union-attr]
            entry = entries.get(sid)
            if entry is None:
                continue
            if code == D2H:
                m.copy_d2h(entry)
            elif code == RELEASE:
                m.release_device(entry)
            elif code == H2D:
                m.copy_h2d(entry)
            elif code == RELEASE_FINAL:
                m.release_device(entry, final=True)
            else:
                m.release_host(entry)

    # --- opaque regions -------------------------------------------------------------
    def begin_opaque(self, name: str, reads: list[torch.UntypedStorage]) -> int | None:
        i = self.index
        self.index = i + 1
        p = self.program
        if self.safe or i >= self._n or p.keys[i] != name:
            if not self.safe:
                self._diverge(i, name, None)
            self.page_in_storages(reads)
            return None
        pre = p.pre[i]
        if pre is not None:
            self._act(pre)
        m = self.manager
        if m.evicted or m.inflight:
            self.page_in_storages(reads)
        writes = p.writes[i]
        if writes is not None:
            self._before_writes(writes)
        if self.timer is not None:
            self._opaque_marks.append(self.timer.mark())
        return i

    def end_opaque(self, token: int | None, outputs: list[Tensor]) -> None:
        if token is not None and self.timer is not None and self._opaque_marks:
            self.op_marks.append((self.program.names[token], self._opaque_marks.pop(), self.timer.mark()))
        if token is None or self.safe:
            return
        leaves = list(outputs)
        if not self._meta_matches(self.program.meta[token], leaves):
            self._diverge(token, self.program.names[token], leaves)
            return
        self._after(token, leaves, None)

    # --- divergence and end of step -------------------------------------------------
    def _diverge(self, i: int, actual: str, leaves: list[Any] | None) -> None:
        p = self.program
        self.safe = True
        if self.diverged_at is None:
            self.diverged_at = i
        if i >= self._n:
            msg = f"replay diverged from the trace at op {i}: the trace has only {self._n} ops, got {actual}"
        else:
            msg = f"replay diverged from the trace at op {i}: expected {p.names[i]} -> {_describe(p.meta[i])}"
            msg += f", got {actual}" + ("" if leaves is None else f" -> {_describe(leaves)}")
        if self._raise:
            raise OffloadDivergenceError(msg)
        logger.warning("%s; finishing this step by demand paging and re-tracing at the next entry", msg)

    def finish(self, clean: bool, step_ms: float) -> tuple[StepReport, Exception | None]:
        self.closed = True
        m = self.manager
        m.restore_all()
        pending: Exception | None = None
        if clean and self.diverged_at is None and self.index < self._n:
            self.diverged_at = self.index
            msg = (f"replay diverged from the trace at op {self.index}: the step ended after {self.index} "
                   f"ops, the trace has {self._n} (next expected {self.program.names[self.index]})")
            if self._raise:
                pending = OffloadDivergenceError(msg)
            else:
                logger.warning("%s; re-tracing at the next entry", msg)
        report = StepReport(
            phase="replay", op_count=self.index, peak_resident_bytes=self.peak_bytes,
            budget_bytes=self.budget_bytes, bytes_d2h=m.bytes_d2h, bytes_h2d=m.bytes_h2d,
            demand_faults=m.demand_faults, step_ms=step_ms,
            overshoot_bytes=max(self.peak_bytes - self.budget_bytes, 0),
            overshoot_op=self.peak_op if self.peak_bytes > self.budget_bytes else None,
            offload_cap_hits=m.cap_hits, diverged_at=self.diverged_at,
        )
        return report, pending
