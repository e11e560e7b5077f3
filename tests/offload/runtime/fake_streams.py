"""A stream and event backend for ``StreamCopyEngine`` on CPU: one compute stream, copy
streams whose work completes late (seeded), and the copy rules checked as it does.

The compute stream is the host itself (CPU ops run at once), so ``compute.wait_event(e)``
runs ``e``'s stream up to ``e`` before the next op, which is what a GPU's compute stream
guarantees its later kernels. A copy stream runs its items in order: a copy only once its
seeded delay has passed (or someone waits), a ``wait_event`` only once that event is done.
Freed memory that a copy still uses is legal only where ``record_stream`` told the
allocator (here: the copy reads the bytes its source had at issue, or writes nowhere).
Extra rule of this backend: a copy must be enqueued after its stream waited for the
compute stream (since that stream's previous copy).
"""

from __future__ import annotations

import random
from collections import deque
from typing import Any

import torch

from hyperpar.offload.runtime.copy_rules import CopyRules, Delays, PendingCopy, clone, no_modes


class FakeEvent:
    def __init__(self, backend: FakeStreams) -> None:
        self.backend = backend
        self.done = False
        self.recorded = False
        self.lane = ""
        self.seq = -1  # the last copy of its stream it covers
        self.frontier: dict[str, int] = {}
        self.tick = 0

    def record(self, stream: FakeStream | None = None) -> None:
        stream = self.backend.compute if stream is None else stream
        self.recorded = True
        self.done = False
        if stream.compute:  # the host is the compute stream: everything before is done
            self.done, self.tick = True, self.backend.clock
            return
        self.lane, self.seq, self.frontier = stream.name, stream.seq - 1, dict(stream.frontier)
        stream.items.append(("record", self, 0.0))
        self.backend.advance()

    def query(self) -> bool:
        if not self.done:
            self.backend.tick()
            self.backend.rules.raise_first()
        return self.done or not self.recorded

    def synchronize(self) -> None:
        self.backend.run_until(self)
        self.backend.rules.raise_first()

    def elapsed_time(self, other: FakeEvent) -> float:
        return (other.tick - self.tick) * 1e-3


class FakeStream:
    def __init__(self, backend: FakeStreams, name: str, compute: bool = False) -> None:
        self.backend, self.name, self.compute = backend, name, compute
        self.items: deque[tuple[str, Any, float]] = deque()
        self.seq = 0  # copies enqueued so far
        self.frontier: dict[str, int] = {}  # what every item enqueued from now on comes after
        self.synced = False  # waited for the compute stream since its last copy

    def wait_stream(self, other: FakeStream) -> None:
        if other.compute:
            self.synced = True  # the compute stream's work is done when the host gets here
            return
        event = FakeEvent(self.backend)
        event.record(other)
        self.wait_event(event)

    def wait_event(self, event: Any) -> None:
        b = self.backend
        if not isinstance(event, FakeEvent) or event.backend is not b or not event.recorded:
            b.rules.violate(f"stream {self.name} waits for {event!r}, not an event recorded on a stream")
            b.rules.raise_first()
            return
        if self.compute:
            b.run_until(event)
            b.rules.raise_first()
            return
        if event.lane:
            self.frontier = _merged(self.frontier, event.frontier, event.lane, event.seq)
        self.items.append(("wait", event, 0.0))

    def synchronize(self) -> None:
        while self.items:
            self.backend.force(self)
        self.backend.rules.raise_first()


def _merged(a: dict[str, int], b: dict[str, int], lane: str, seq: int) -> dict[str, int]:
    out = dict(a)
    for k, v in b.items():
        out[k] = max(out.get(k, -1), v)
    out[lane] = max(out.get(lane, -1), seq)
    return out


class FakeStreams:
    """The backend; ``copies`` and ``violations`` are there to assert on."""

    def __init__(self, seed: int = 0, timing: str = "mixed") -> None:
        self.rng = random.Random(seed)
        self.delays = Delays(self.rng, timing)
        self.rules = CopyRules()
        self.compute = FakeStream(self, "compute", compute=True)
        self.copy_streams: list[FakeStream] = []
        self.clock = 0
        self.copies = 0
        self._last: dict[str, PendingCopy] = {}  # each stream's last copy (for record_stream)

    @property
    def violations(self) -> list[str]:
        return self.rules.violations

    # --- what StreamCopyEngine calls ------------------------------------------------
    def stream(self) -> FakeStream:
        s = FakeStream(self, f"copy{len(self.copy_streams)}")
        self.copy_streams.append(s)
        return s

    def event(self, timing: bool) -> FakeEvent:
        return FakeEvent(self)

    def current_stream(self) -> FakeStream:
        return self.compute

    def copy(self, stream: FakeStream, dst: torch.Tensor, src: torch.Tensor) -> None:
        if stream.compute:
            self.rules.violate("a copy was enqueued on the compute stream")
        elif not stream.synced:
            self.rules.violate(f"a copy on {stream.name} was enqueued without waiting for the compute "
                               f"stream first (its source may not be written yet)")
        stream.synced = False
        with no_modes():
            snapshot = clone(src)
        c = PendingCopy(stream.name, stream.seq, dst, src, snapshot, dict(stream.frontier))
        stream.seq += 1
        self.copies += 1
        self.rules.issued(c)
        self._last[stream.name] = c
        stream.items.append(("copy", c, self.delays.due(self.clock)))
        self.advance()
        self.rules.raise_first()

    def source_may_change(self, stream: FakeStream) -> None:
        """The stream's last copy reads a source the user may write meanwhile: a change tears
        it (``PendingCopy.src_shared``) instead of breaking a rule (a copy done already read it)."""
        c = self._last.get(stream.name)
        if c is not None:
            c.src_shared = True

    def record_stream(self, tensor: torch.Tensor, stream: FakeStream) -> None:
        c = self._last.get(stream.name)
        if c is not None and (tensor is c.src or tensor is c.dst):
            c.held.add(id(tensor))

    # --- time -----------------------------------------------------------------------
    def tick(self) -> None:
        self.clock += 1
        self.advance()

    def advance(self) -> None:
        progress = True
        while progress:
            progress = False
            streams = list(self.copy_streams)
            self.rng.shuffle(streams)
            for s in streams:
                while s.items and self._ready(s.items[0]):
                    self._run(s, s.items.popleft())
                    progress = True

    def _ready(self, item: tuple[str, Any, float]) -> bool:
        kind, obj, due = item
        if kind == "wait":
            return obj.done
        return kind == "record" or due <= self.clock

    def _run(self, stream: FakeStream, item: tuple[str, Any, float]) -> None:
        kind, obj, _ = item
        if kind == "copy":
            self.rules.complete(obj)
            if self._last.get(stream.name) is obj:
                del self._last[stream.name]
            obj.dst = obj.src = obj.snapshot = None  # the stream lets go once done
        elif kind == "record":
            obj.done, obj.tick = True, self.clock

    def force(self, stream: FakeStream) -> None:
        """Run ``stream``'s next item now (its wait first, if it waits)."""
        kind, obj, _ = stream.items[0]
        if kind == "wait" and not obj.done:
            self.run_until(obj)
        self._run(stream, stream.items.popleft())

    def run_until(self, event: FakeEvent) -> None:
        if not event.recorded:
            return
        stream = next((s for s in self.copy_streams if s.name == event.lane), None)
        while not event.done and stream is not None and stream.items:
            self.force(stream)
