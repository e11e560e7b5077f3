"""The accelerator copy engine: a D2H and an H2D stream, events, no host blocking.

Every copy first waits for the compute stream (its source was produced there, or its
destination was allocated there) and for ``after``; the compute stream later waits on the
copy's event only when an op touches that storage. A device buffer a copy uses is
``record_stream``-ed on the copy stream, so a storage that dies while its copy runs can
never hand its memory to a kernel before the copy is done. A storage the residency manager
releases is freed only once its D2H is done (``may_free_now``): until then its bytes count
against the budget, which waits for them (``finish``) rather than growing.

The stream and event calls go through a backend: ``TorchStreams`` (``torch.Stream``,
``torch.Event``, ``torch.accelerator``: device-neutral, CUDA unchanged) in use, or a fake
that runs the same ordering logic on CPU with copies that complete late (the tests'
``FakeStreams``), so what this engine waits for is checked without a GPU.
"""

from __future__ import annotations

from typing import Any

import torch

from hyperpar.offload.runtime.copy_engine import D2H_LANE, H2D_LANE, CopySpan


class TorchStreams:
    """The real backend: torch's device-neutral streams and events."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def stream(self) -> Any:
        return torch.Stream(device=self.device)

    def event(self, timing: bool) -> Any:
        return torch.Event(device=self.device, enable_timing=timing)

    def current_stream(self) -> Any:
        return torch.accelerator.current_stream(self.device)

    def copy(self, stream: Any, dst: torch.Tensor, src: torch.Tensor) -> None:
        """``dst.copy_(src)`` enqueued on ``stream``."""
        compute = torch.accelerator.current_stream(self.device)
        torch.accelerator.set_stream(stream)
        try:
            dst.copy_(src, non_blocking=True)
        finally:
            torch.accelerator.set_stream(compute)

    def record_stream(self, tensor: torch.Tensor, stream: Any) -> None:
        tensor.record_stream(stream)


class StreamCopyEngine:
    name = "stream"
    asynchronous = True

    def __init__(self, device: torch.device, backend: Any = None) -> None:
        self.device = device
        self.backend = TorchStreams(device) if backend is None else backend
        b = self.backend
        self._streams = {D2H_LANE: b.stream(), H2D_LANE: b.stream()}
        self._timed: list[tuple[str, int, int, Any, Any]] = []
        self._waits: list[tuple[Any, Any]] = []
        self._origin: Any = None
        self._spans: list[CopySpan] = []
        self._wait_ms = 0.0
        self.timing = True

    def _event(self) -> Any:
        return self.backend.event(self.timing)

    def _copy(self, lane: str, dst: torch.Tensor, src: torch.Tensor, after: Any, label: int,
              device_side: torch.Tensor) -> Any:
        b = self.backend
        stream = self._streams[lane]
        stream.wait_stream(b.current_stream())
        if after is not None:
            stream.wait_event(after)
        start = self._event() if self.timing else None
        if start is not None:
            start.record(stream)
        b.copy(stream, dst, src)
        done = self._event()
        done.record(stream)
        b.record_stream(device_side, stream)
        if start is not None:
            self._timed.append((lane, label, src.nbytes, start, done))
        return done

    def copy_d2h(self, dst: torch.Tensor, src: torch.Tensor, after: Any = None, label: int = -1) -> Any:
        return self._copy(D2H_LANE, dst, src, after, label, src)

    def copy_h2d(self, dst: torch.Tensor, src: torch.Tensor, after: Any = None, label: int = -1) -> Any:
        return self._copy(H2D_LANE, dst, src, after, label, dst)

    def is_done(self, event: Any) -> bool:
        return event is None or event.query()

    def source_may_change(self, event: Any) -> None:
        """The last copy out reads a storage the user may write meanwhile (the fast path's): a
        backend that checks what copies read is told (a real stream just reads what it reads)."""
        mark = getattr(self.backend, "source_may_change", None)
        if mark is not None:
            mark(self._streams[D2H_LANE])

    def wait(self, event: Any) -> None:
        if event is None or event.query():
            return
        compute = self.backend.current_stream()
        if self.timing:
            before, after = self._event(), self._event()
            before.record(compute)
            compute.wait_event(event)
            after.record(compute)
            self._waits.append((before, after))
        else:
            compute.wait_event(event)

    def finish(self, event: Any) -> None:
        if event is not None:
            event.synchronize()

    def may_free_now(self, src: torch.Tensor, event: Any) -> bool:
        return event is None or event.query()

    def poll(self) -> None:
        return None

    def begin_step(self) -> None:
        self._timed.clear()
        self._waits.clear()
        self._spans = []
        self._wait_ms = 0.0
        if self.timing:
            self._origin = self._event()
            self._origin.record(self.backend.current_stream())

    def synchronize(self) -> None:
        for stream in self._streams.values():
            stream.synchronize()

    def end_step(self) -> None:
        """Reads the step's events (one host sync at the end of the step, not per copy)."""
        self.synchronize()
        self.backend.current_stream().synchronize()
        origin = self._origin
        if origin is not None:
            self._spans = [CopySpan(lane, label, nbytes, origin.elapsed_time(s), origin.elapsed_time(e))
                           for lane, label, nbytes, s, e in self._timed]
        self._wait_ms = sum(b.elapsed_time(a) for b, a in self._waits)
        self._timed.clear()
        self._waits.clear()

    def exposed_wait_ms(self) -> float:
        return self._wait_ms

    def spans(self) -> list[CopySpan]:
        return self._spans

    def close(self) -> None:
        self.synchronize()
