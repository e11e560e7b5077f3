"""The accelerator copy engine: a D2H and an H2D stream, events, no host blocking.

Device-neutral (``torch.Stream``, ``torch.Event``, ``torch.accelerator``), so it runs on
CUDA unchanged and on any accelerator torch exposes the same way. Every copy first waits
for the compute stream (its source was produced there, or its destination was allocated
there) and for ``after``; the compute stream later waits on the copy's event only when an
op touches that storage. A device buffer a copy uses is ``record_stream``-ed on the copy
stream, so freeing it on the compute side can never hand its memory to a kernel while the
copy still runs.
"""

from __future__ import annotations

from typing import Any

import torch

from hyperpar.offload.runtime.copy_engine import D2H_LANE, H2D_LANE, CopySpan


class StreamCopyEngine:
    name = "stream"
    asynchronous = True

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._streams = {D2H_LANE: torch.Stream(device=device), H2D_LANE: torch.Stream(device=device)}
        self._timed: list[tuple[str, int, int, torch.Event, torch.Event]] = []
        self._waits: list[tuple[torch.Event, torch.Event]] = []
        self._origin: torch.Event | None = None
        self._spans: list[CopySpan] = []
        self._wait_ms = 0.0
        self.timing = True

    def _event(self) -> torch.Event:
        return torch.Event(device=self.device, enable_timing=self.timing)

    def _copy(self, lane: str, dst: torch.Tensor, src: torch.Tensor, after: Any, label: int,
              device_side: torch.Tensor) -> torch.Event:
        stream = self._streams[lane]
        compute = torch.accelerator.current_stream(self.device)
        stream.wait_stream(compute)
        if after is not None:
            stream.wait_event(after)
        start = self._event() if self.timing else None
        torch.accelerator.set_stream(stream)
        try:
            if start is not None:
                start.record(stream)
            dst.copy_(src, non_blocking=True)
            done = self._event()
            done.record(stream)
        finally:
            torch.accelerator.set_stream(compute)
        device_side.record_stream(stream)
        if start is not None:
            self._timed.append((lane, label, src.nbytes, start, done))
        return done

    def copy_d2h(self, dst: torch.Tensor, src: torch.Tensor, after: Any = None,
                 label: int = -1) -> torch.Event:
        return self._copy(D2H_LANE, dst, src, after, label, src)

    def copy_h2d(self, dst: torch.Tensor, src: torch.Tensor, after: Any = None,
                 label: int = -1) -> torch.Event:
        return self._copy(H2D_LANE, dst, src, after, label, dst)

    def is_done(self, event: Any) -> bool:
        return event is None or event.query()

    def wait(self, event: Any) -> None:
        if event is None or event.query():
            return
        compute = torch.accelerator.current_stream(self.device)
        if self.timing:
            before, after = self._event(), self._event()
            before.record(compute)
            compute.wait_event(event)
            after.record(compute)
            self._waits.append((before, after))
        else:
            compute.wait_event(event)

    def may_free_now(self, src: torch.Tensor, event: Any) -> bool:
        return True  # record_stream at issue keeps the memory from reuse until the copy is done

    def poll(self) -> None:
        return None

    def begin_step(self) -> None:
        self._timed.clear()
        self._waits.clear()
        self._spans = []
        self._wait_ms = 0.0
        if self.timing:
            self._origin = self._event()
            self._origin.record(torch.accelerator.current_stream(self.device))

    def synchronize(self) -> None:
        for stream in self._streams.values():
            stream.synchronize()

    def end_step(self) -> None:
        """Reads the step's events (one host sync at the end of the step, not per copy)."""
        self.synchronize()
        torch.accelerator.current_stream(self.device).synchronize()
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
