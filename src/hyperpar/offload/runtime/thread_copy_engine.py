"""The CPU copy engine: one worker thread per direction, events the compute thread waits on.

On CPU the "device" is CPU memory, yet copies still run beside compute (torch releases the
GIL inside ``copy_``), so asynchrony and its races are exercised in CI as on a GPU. Each lane
runs its copies in issue order. Tensors handed to a lane are dropped on the compute thread
(``poll``), never on the worker: dropping the last reference to a storage runs the residency
manager's weakref callback, which must not race with the compute thread.
"""

from __future__ import annotations

import queue
import threading
import time
import weakref
from typing import Any

import torch

from hyperpar.offload.runtime.copy_engine import D2H_LANE, H2D_LANE, CopySpan


class ThreadEvent:
    """Completed by a worker; ``synchronize`` re-raises the copy's error, if any."""

    __slots__ = ("_flag", "error")

    def __init__(self) -> None:
        self._flag = threading.Event()
        self.error: BaseException | None = None

    def query(self) -> bool:
        return self._flag.is_set()

    def synchronize(self) -> None:
        self._flag.wait()
        if self.error is not None:
            raise RuntimeError(f"asynchronous copy failed: {self.error}") from self.error


class _Lane:
    def __init__(self, name: str, delay_s: float) -> None:
        self.name = name
        self.delay_s = delay_s
        self.tasks: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.retired: list[list[torch.Tensor]] = []  # payloads whose copy is done
        self.spans: list[CopySpan] = []
        self.origin = time.perf_counter()
        self.last: ThreadEvent | None = None
        self.thread: threading.Thread | None = None  # started by the first hand-off

    def submit(self, payload: list[torch.Tensor], after: ThreadEvent | None, label: int) -> ThreadEvent:
        if self.thread is None:
            self.thread = threading.Thread(target=self._run, name=f"hyperpar-copy-{self.name}", daemon=True)
            self.thread.start()
        event = ThreadEvent()
        self.tasks.put((payload, event, after, label))
        self.last = event
        return event

    def stop(self) -> None:
        if self.thread is not None:
            self.tasks.put(None)

    def _run(self) -> None:
        while True:
            task = self.tasks.get()
            if task is None:
                return
            payload, event, after, label = task
            del task
            t0 = time.perf_counter()
            try:
                if after is not None:
                    after._flag.wait()
                if self.delay_s:
                    time.sleep(self.delay_s)
                t0 = time.perf_counter()
                payload[0].copy_(payload[1])  # no reference outlives this statement
            except BaseException as exc:  # reported to whoever waits on the event
                event.error = exc
            t1 = time.perf_counter()
            nbytes = payload[1].nbytes if not event.error else 0
            self.spans.append(CopySpan(self.name, label, nbytes, (t0 - self.origin) * 1e3,
                                       (t1 - self.origin) * 1e3))
            self.retired.append(payload)  # list.append is atomic; the compute thread empties it
            del payload
            event._flag.set()


# Copies up to 1 MiB run inline: handing one to a lane (a queue, an event, the worker's wake-up
# and its GIL hand-back) cost more than the copy itself on this CPU. Measured at 64 KiB, then
# 1 MiB, fast replay at 50 % of the peak, CPU time / plain: HF GPT-2 1.67 -> 1.33, HF Mixtral
# 1.56 -> 1.40; the demo's compute-bound GPT, wall time / plain 1.11 -> 1.09. Tests of
# asynchrony use ``delay_s`` (which hands off every copy) or the chaos engine.
INLINE_BYTES = 1 << 20


class ThreadCopyEngine:
    """Copies of at most ``inline_bytes`` run at once on the caller (cheaper than a hand-off,
    and their memory is free at once). ``delay_s`` sleeps before every copy, none inline: a
    test engine on which any missing wait shows."""

    name = "thread"
    asynchronous = True

    def __init__(self, delay_s: float = 0.0, inline_bytes: int | None = None) -> None:
        if delay_s < 0:
            raise ValueError(f"delay_s must be >= 0, got {delay_s!r}")
        self.delay_s = delay_s
        self.name = "thread" if not delay_s else f"thread(delay {delay_s:g} s)"  # probe cache key
        self.inline_bytes = (0 if delay_s else INLINE_BYTES) if inline_bytes is None else inline_bytes
        self._d2h = _Lane(D2H_LANE, delay_s)
        self._h2d = _Lane(H2D_LANE, delay_s)
        self._wait_s = 0.0
        self._finalizer = weakref.finalize(self, _stop_lanes, self._d2h, self._h2d)

    def copy_d2h(self, dst: torch.Tensor, src: torch.Tensor, after: Any = None,
                 label: int = -1) -> ThreadEvent | None:
        if src.nbytes <= self.inline_bytes and (after is None or after._flag.is_set()):
            return self._inline(self._d2h, dst, src, label)
        return self._d2h.submit([dst, src], after, label)

    def copy_h2d(self, dst: torch.Tensor, src: torch.Tensor, after: Any = None,
                 label: int = -1) -> ThreadEvent | None:
        if src.nbytes <= self.inline_bytes and (after is None or after._flag.is_set()):
            return self._inline(self._h2d, dst, src, label)
        return self._h2d.submit([dst, src], after, label)

    @staticmethod
    def _inline(lane: _Lane, dst: torch.Tensor, src: torch.Tensor, label: int) -> None:
        t0 = time.perf_counter()
        dst.copy_(src)
        t1 = time.perf_counter()
        lane.spans.append(CopySpan(lane.name, label, src.nbytes, (t0 - lane.origin) * 1e3,
                                   (t1 - lane.origin) * 1e3))

    def is_done(self, event: Any) -> bool:
        return event is None or event._flag.is_set()

    def wait(self, event: Any) -> None:
        if event is None:
            return
        if not event._flag.is_set():
            t0 = time.perf_counter()
            event._flag.wait()
            self._wait_s += time.perf_counter() - t0
        if event.error is not None:
            event.synchronize()

    def finish(self, event: Any) -> None:
        self.wait(event)

    def may_free_now(self, src: torch.Tensor, event: Any) -> bool:
        return event is None or event._flag.is_set()

    def poll(self) -> None:
        for lane in (self._d2h, self._h2d):
            retired = lane.retired
            while retired:
                retired.pop().clear()

    def begin_step(self) -> None:
        now = time.perf_counter()
        for lane in (self._d2h, self._h2d):
            lane.origin = now
            lane.spans = []
        self._wait_s = 0.0

    def synchronize(self) -> None:
        for lane in (self._d2h, self._h2d):
            last = lane.last
            if last is not None and not last._flag.is_set():  # wait() takes a lock even when set
                last._flag.wait()
        self.poll()

    def end_step(self) -> None:
        self.synchronize()

    def exposed_wait_ms(self) -> float:
        return self._wait_s * 1e3

    def spans(self) -> list[CopySpan]:
        return sorted(self._d2h.spans + self._h2d.spans, key=lambda s: s.start_ms)

    def close(self) -> None:
        self.synchronize()
        self._finalizer()


def _stop_lanes(*lanes: _Lane) -> None:
    for lane in lanes:
        lane.stop()
