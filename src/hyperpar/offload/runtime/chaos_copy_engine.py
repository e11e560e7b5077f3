"""A copy engine for tests and debugging: seeded, adversarial completion timing, rules checked.

A real asynchronous engine finishes a copy whenever its stream or thread gets to it, so a
missing wait shows only on the runs where the copy happens to be late. This engine makes
the lateness a choice: each copy completes after a seeded number of engine calls (at once,
soon, late, or only when someone waits on it), the two lanes complete in a seeded order
relative to each other (each lane stays first-in first-out, as a stream does), and
everything runs on the caller's thread, so one seed is one exact interleaving, every run.
Every copy is checked against ``copy_rules`` (nothing read before its event, no source
freed or changed before its copy is done), and every wait must be for a copy this engine
issued.

Select it with ``OffloadConfig(copy_engine="chaos:SEED")`` or, for sessions left at
``"auto"``, the environment variable ``HYPERPAR_COPY_ENGINE=chaos:SEED``.
"""

from __future__ import annotations

import random
import threading
import time
from typing import Any

import torch

from hyperpar.offload.runtime.copy_engine import D2H_LANE, H2D_LANE, CopySpan
from hyperpar.offload.runtime.copy_rules import (
    CopyRules,
    CopyRuleViolation,
    Delays,
    PendingCopy,
    clone,
    no_modes,
)

__all__ = ["ChaosCopyEngine", "ChaosEvent", "CopyRuleViolation"]


class ChaosEvent:
    """Completed by the engine; ``query`` lets time pass, as polling a real event does."""

    __slots__ = ("after", "copy", "done", "engine")

    def __init__(self, engine: ChaosCopyEngine, copy: PendingCopy, after: ChaosEvent | None) -> None:
        self.engine = engine
        self.copy = copy
        self.after = after
        self.done = False

    def query(self) -> bool:
        if not self.done:
            self.engine._tick()
            self.engine.rules.raise_first()
        return self.done

    def synchronize(self) -> None:
        self.engine.wait(self)


class ChaosCopyEngine:
    name = "chaos"
    asynchronous = True

    def __init__(self, seed: int = 0, raise_on_violation: bool = True, timing: str = "mixed") -> None:
        """``timing``: "mixed" (each copy at once, soon, late or only when waited on, in a
        mix the seed picks), "never" (every copy only when waited on) or "instant"."""
        if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
            raise ValueError(f"ChaosCopyEngine seed must be an int >= 0, got {seed!r}")
        self.seed = seed
        self.name = f"chaos(seed {seed})"  # the bandwidth probe's cache key
        self.rules = CopyRules(raise_on_violation)
        self._rng = random.Random(seed)
        self._delays = Delays(self._rng, timing)
        self._lanes: dict[str, list[tuple[float, ChaosEvent]]] = {D2H_LANE: [], H2D_LANE: []}
        self._clock = 0
        self._seq = 0
        self._retired: list[PendingCopy] = []  # completed: tensors dropped in ``poll``, on the caller
        self._spans: list[CopySpan] = []
        self._origin = time.perf_counter()
        self._wait_s = 0.0
        self._lock = threading.RLock()
        self.copies = 0  # issued, over the engine's life
        self.forced = 0  # completed because someone waited on them

    @property
    def violations(self) -> list[str]:
        return self.rules.violations

    # --- the contract ---------------------------------------------------------------
    def copy_d2h(self, dst: torch.Tensor, src: torch.Tensor, after: Any = None,
                 label: int = -1) -> ChaosEvent:
        return self._issue(D2H_LANE, dst, src, after, label)

    def copy_h2d(self, dst: torch.Tensor, src: torch.Tensor, after: Any = None,
                 label: int = -1) -> ChaosEvent:
        return self._issue(H2D_LANE, dst, src, after, label)

    def is_done(self, event: Any) -> bool:
        if event is None:
            return True
        return not self._own(event, "is_done") or event.query()

    def wait(self, event: Any) -> None:
        if event is None or not self._own(event, "wait") or event.done:
            return
        t0 = time.perf_counter()
        with self._lock:
            self.forced += 1
            self._complete_through(event)
        self._wait_s += time.perf_counter() - t0
        self.rules.raise_first()

    def finish(self, event: Any) -> None:
        self.wait(event)

    def may_free_now(self, src: torch.Tensor, event: Any) -> bool:
        return self.is_done(event)

    def poll(self) -> None:
        self._tick()
        retired = self._retired
        while retired:
            c = retired.pop()
            c.dst = c.src = c.snapshot = None  # type: ignore[assignment]
        self.rules.raise_first()

    def begin_step(self) -> None:
        self._origin = time.perf_counter()
        self._spans = []
        self._wait_s = 0.0

    def synchronize(self) -> None:
        with self._lock:
            for lane in self._lanes.values():
                while lane:
                    self._complete_through(lane[-1][1])
        self.poll()

    def end_step(self) -> None:
        self.synchronize()

    def exposed_wait_ms(self) -> float:
        return self._wait_s * 1e3

    def spans(self) -> list[CopySpan]:
        return sorted(self._spans, key=lambda s: s.start_ms)

    def close(self) -> None:
        self.synchronize()

    # --- issue and completion -------------------------------------------------------
    def _issue(self, lane: str, dst: torch.Tensor, src: torch.Tensor, after: Any, label: int) -> ChaosEvent:
        if after is not None and not self._own(after, "a copy's 'after'"):
            after = None
        with self._lock:
            self._clock += 1
            frontier: dict[str, int] = {}
            if after is not None:  # everything ``after`` waited for, and ``after`` itself
                frontier = dict(after.copy.frontier)
                frontier[after.copy.lane] = max(frontier.get(after.copy.lane, -1), after.copy.seq)
            with no_modes():  # (called between ops too: from autograd hooks)
                snapshot = clone(src)
            copy = PendingCopy(lane, self._seq, dst, src, snapshot, frontier, label,
                               (time.perf_counter() - self._origin) * 1e3)
            self._seq += 1
            self.copies += 1
            self.rules.issued(copy)
            event = ChaosEvent(self, copy, after)
            self._lanes[lane].append((self._delays.due(self._clock), event))
            self._advance()
        self.rules.raise_first()
        return event

    def source_may_change(self, event: Any) -> None:
        """The source of this copy is the user's to write while it runs (the fast path copies
        out storages Python may still hold): a change before it completes is no violation,
        but the copy lands torn (poisoned), so a user of its bytes shows as NaNs."""
        if self._own(event, "source_may_change"):
            event.copy.src_shared = True

    def _tick(self) -> None:
        with self._lock:
            self._clock += 1
            self._advance()

    def _advance(self) -> None:
        """Complete every lane head that is due and whose 'after' is done, lanes in a seeded order."""
        progress = True
        while progress:
            progress = False
            names = list(self._lanes)
            self._rng.shuffle(names)
            for name in names:
                lane = self._lanes[name]
                if lane:
                    due, event = lane[0]
                    if due <= self._clock and (event.after is None or event.after.done):
                        self._complete(lane.pop(0)[1])
                        progress = True

    def _complete_through(self, event: ChaosEvent) -> None:
        lane = self._lanes[event.copy.lane]
        while not event.done:
            head = lane[0][1]
            if head.after is not None and not head.after.done:
                self._complete_through(head.after)
            self._complete(lane.pop(0)[1])

    def _complete(self, event: ChaosEvent) -> None:
        c = event.copy
        self.rules.complete(c)
        event.done = True
        self._spans.append(CopySpan(c.lane, c.label, c.src.nbytes, c.issued_ms,
                                    (time.perf_counter() - self._origin) * 1e3))
        self._retired.append(c)

    def _own(self, event: Any, what: str) -> bool:
        if isinstance(event, ChaosEvent) and event.engine is self:
            return True
        self.rules.violate(f"{what} was given {event!r}, not an event of a copy this engine issued")
        self.rules.raise_first()
        return False
