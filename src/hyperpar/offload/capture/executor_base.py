"""What warmup and replay share: the op entry point, opaque regions, demand paging."""

from __future__ import annotations

from typing import Any

import torch

from hyperpar.offload.capture.op_args import storage_of, tensor_inputs
from hyperpar.offload.ir.report import StepReport
from hyperpar.offload.runtime import OpTimer, ResidencyManager, StepTimeline
from hyperpar.offload.runtime.copy_engine import CopySpan

# func -> whether it is a c10d collective (cached: this is on every op's path).
_COLLECTIVE: dict[Any, bool] = {}


def is_collective(func: Any) -> bool:
    found = _COLLECTIVE.get(func)
    if found is None:
        found = _COLLECTIVE[func] = getattr(func, "namespace", None) == "c10d"
    return found


class ExecutorBase:
    phase = "base"

    def __init__(self, manager: ResidencyManager, device: torch.device, budget_bytes: int) -> None:
        self.manager = manager
        self.device = device
        self.budget_bytes = budget_bytes
        self.opaque_depth = 0  # > 0 inside skip_offload: ops run untraced
        self.passthrough = 0  # > 0 while our own copies run: ops run untouched
        self.closed = False
        self.timer: OpTimer | None = None  # op boundaries (warmup: durations; replay: timeline)
        self.op_marks: list[tuple[str, int, int]] = []  # (name, begin mark, end mark)

    def dispatch(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if self.passthrough:
            return func(*args, **kwargs)
        if is_collective(func):
            # An async collective (async_op=True) reads and writes its buffers after the op
            # returns, until work.wait(): they must never be evicted in this step.
            self.manager.pin(self.device_storages(tensor_inputs(args, kwargs)))
        if self.opaque_depth:
            self.untraced_op(func, args, kwargs)
            return func(*args, **kwargs)
        return self.run_op(func, args, kwargs)

    def untraced_op(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """An op inside a skip_offload region: not traced, but a 0-byte (evicted) storage
        must still never reach a kernel."""
        m = self.manager
        if m.evicted or m.inflight:
            m.page_in_inputs(tensor_inputs(args, kwargs))

    def device_storages(self, tensors: list[torch.Tensor]) -> list[torch.UntypedStorage]:
        dev = self.device
        out = []
        for t in tensors:
            if t.device == dev:
                st = storage_of(t)
                if st is not None:
                    out.append(st)
        return out

    def page_in_storages(self, storages: list[torch.UntypedStorage]) -> None:
        m = self.manager
        for st in storages:
            entry = m.evicted.get(st._cdata)
            if entry is not None and entry.ref() is st:
                m.copy_h2d(entry, demand=True)
                continue
            entry = m.inflight.get(st._cdata)
            if entry is not None and entry.ref() is st:
                m.wait_h2d(entry)

    def describe_op(self) -> str:
        """Names the op now running, for error messages."""
        return "outside an op"

    def timeline(self, copies: list[CopySpan]) -> StepTimeline:
        """The step's ops (from the timer's marks) with the engine's copies."""
        timer = self.timer
        times = timer.times_ms() if timer is not None else []
        ops = [(name, times[b], times[e]) for name, b, e in self.op_marks if e < len(times)]
        clock = "device" if timer is not None and timer.use_events else "host"
        return StepTimeline(ops=ops, copies=list(copies), clock=clock)

    # --- per phase ------------------------------------------------------------------
    def run_op(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        raise NotImplementedError

    def begin_opaque(self, name: str, reads: list[torch.UntypedStorage]) -> Any:
        """Start a skip_offload region as one op reading ``reads``; returns a token."""
        raise NotImplementedError

    def end_opaque(self, token: Any, outputs: list[torch.Tensor]) -> None:
        raise NotImplementedError

    def finish(self, clean: bool, step_ms: float) -> tuple[StepReport, Exception | None]:
        """Page every live storage back in; returns the report and an error to raise, if any."""
        raise NotImplementedError
