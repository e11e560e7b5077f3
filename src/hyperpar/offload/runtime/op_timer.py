"""Per-op start/end times of one step, without blocking the host after each op.

On an accelerator each boundary records an event on the compute stream (events are reused
across steps); the times are read once, at the end of the step. On CPU the op has finished
when it returns, so ``perf_counter`` is exact and cheaper.
"""

from __future__ import annotations

import time

import torch


class OpTimer:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.use_events = device.type != "cpu" and torch.accelerator.is_available()
        self._pool: list[torch.Event] = []
        # The host clock at each mark (None with events): warmup's fused op path appends to
        # it directly, as ``mark`` would, to save two calls an op.
        self.host_marks: list[float] | None = None if self.use_events else []
        self._events: list[torch.Event] = []
        self._origin = 0.0

    def begin_step(self) -> None:
        self.host_marks = None if self.use_events else []
        self._pool.extend(self._events)
        self._events = []
        self._origin = time.perf_counter()
        self.mark()

    def end_step(self) -> None:
        """Drop the step's marks once they are read: the timer lives as long as the session."""
        self.host_marks = None if self.use_events else []
        self._pool.extend(self._events)
        self._events = []

    def mark(self) -> int:
        """Record a time point (an op boundary); returns its index."""
        if self.use_events:
            ev = self._pool.pop() if self._pool else torch.Event(device=self.device, enable_timing=True)
            ev.record(torch.accelerator.current_stream(self.device))
            self._events.append(ev)
            return len(self._events) - 1
        marks = self.host_marks
        assert marks is not None
        marks.append(time.perf_counter())
        return len(marks) - 1

    def times_ms(self) -> list[float]:
        """Every mark in ms from the first one (syncs once on an accelerator)."""
        if self.use_events:
            if not self._events:
                return []
            self._events[-1].synchronize()
            first = self._events[0]
            return [first.elapsed_time(ev) for ev in self._events]
        marks = self.host_marks
        if not marks:
            return []
        t0 = marks[0]
        return [(t - t0) * 1e3 for t in marks]

    @property
    def origin_s(self) -> float:
        """The host clock (perf_counter) at the first mark."""
        return self._origin
