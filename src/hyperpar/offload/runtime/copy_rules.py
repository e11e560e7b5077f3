"""The rules every user of a copy engine relies on, checked on copies that complete late.

Shared by the two test engines that choose when a copy happens: ``ChaosCopyEngine`` (the
engine contract itself, under seeded adversarial timing) and ``FakeStreams`` (the real
``StreamCopyEngine``'s stream and event calls, on CPU). Each copy is issued on a lane (a
stream, or an engine lane) at a position ``seq``; its ``frontier`` says, per lane, up to
which position every copy there is certain to be done before it starts (its lane's order,
and the events waited on, transitively). The rules:

* nothing reads a destination before its event: a copy reading bytes another pending copy
  writes must be ordered after it; a destination is filled with 0xFF bytes (a NaN in every
  float dtype) at issue, so a compute read before the wait gives other results, and a
  compute write before it is named when the copy completes;
* nothing frees or reuses a source before its copy is done: at completion the source must
  still hold the bytes it had at issue (or be memory the allocator holds for the copy:
  ``record_stream``), and a copy may not overwrite bytes a pending copy still reads;
* every wait is for a copy that was issued (checked by the engines).

A broken rule is recorded in ``violations`` and the first one raises ``CopyRuleViolation``
at the engine's next public call (``raise_first``), once its own state is whole again.
"""

from __future__ import annotations

import logging
import math
import random
from dataclasses import dataclass, field

import torch

logger = logging.getLogger(__name__)

POISON = 0xFF
# The checks' own ops are no ops of a step: they run with Python dispatch (modes) excluded,
# which, unlike popping the mode stack, also works on threads autograd or TorchScript forks.
_NO_MODES = torch._C.DispatchKeySet(torch._C.DispatchKey.Python) | torch._C.DispatchKeySet(
    torch._C.DispatchKey.PythonTLSSnapshot)


def no_modes() -> torch._C._ExcludeDispatchKeyGuard:
    return torch._C._ExcludeDispatchKeyGuard(_NO_MODES)


def clone(t: torch.Tensor) -> torch.Tensor:
    """The bytes of ``t`` now. The aten op, not ``Tensor.clone``: a session guards that method
    against reads of its activations from other threads, and copies run wherever backward
    does (a TorchScript fork's thread too)."""
    return torch.ops.aten.clone.default(t)
TIMINGS = ("mixed", "never", "instant")


class Delays:
    """When each copy may complete, in engine ticks: at once, soon, late, or only when waited
    on (``inf``): a mix the seed picks ("mixed"), or always the last ("never") or the first
    ("instant")."""

    def __init__(self, rng: random.Random, timing: str = "mixed") -> None:
        if timing not in TIMINGS:
            raise ValueError(f"copy timing must be one of {TIMINGS}, got {timing!r}")
        self.rng, self.timing = rng, timing
        weights = [rng.random() + 0.05 for _ in range(4)]
        self.weights = [w / sum(weights) for w in weights]

    def due(self, clock: int) -> float:
        if self.timing != "mixed":
            return clock if self.timing == "instant" else math.inf
        kind = self.rng.choices(range(4), self.weights)[0]
        if kind == 0:
            return clock
        if kind == 1:
            return clock + self.rng.randint(1, 4)
        if kind == 2:
            return clock + self.rng.randint(5, 60)
        return math.inf


class CopyRuleViolation(RuntimeError):
    """A copy engine's user broke the copy contract (see ``hyperpar.offload.runtime.copy_rules``)."""


@dataclass(slots=True, eq=False)
class PendingCopy:
    lane: str
    seq: int
    dst: torch.Tensor
    src: torch.Tensor
    snapshot: torch.Tensor  # the source's bytes at issue
    frontier: dict[str, int]  # lane -> last position certain to be done before this copy starts
    label: int = -1
    issued_ms: float = 0.0
    dst_guarded: bool = True  # no earlier copy still writes the destination: nothing may
    src_guarded: bool = True  # no earlier copy still writes the source: it may not change
    src_shared: bool = False  # the user may write the source meanwhile: a change tears the copy
    held: set[int] = field(default_factory=set)  # ids of src/dst whose memory the allocator holds

    def name(self) -> str:
        return f"{self.lane} #{self.seq} (storage {self.label}, {self.src.nbytes} bytes)"


def _span(t: torch.Tensor) -> tuple[int, int]:
    """The address range ``t`` covers. Through its storage: ``Tensor.data_ptr`` is one of the
    host reads a session step wraps (and would pin the activation)."""
    start = t.untyped_storage().data_ptr() + t.storage_offset() * t.element_size()
    return start, start + t.nbytes


def _overlap(a: tuple[int, int], b: tuple[int, int]) -> bool:
    return a[0] < b[1] and b[0] < a[1]


def _whole(t: torch.Tensor) -> bool:
    """Whether the storage under ``t`` still holds every byte ``t`` covers (not freed)."""
    return t.untyped_storage().nbytes() >= (t.storage_offset() + t.numel()) * t.element_size()


def ordered_before(old: PendingCopy, new: PendingCopy) -> bool:
    """Whether ``old`` is certain to be done before ``new`` starts."""
    if old.lane == new.lane:
        return old.seq < new.seq
    return new.frontier.get(old.lane, -1) >= old.seq


class CopyRules:
    def __init__(self, raise_on_violation: bool = True) -> None:
        self.raise_on_violation = raise_on_violation
        self.violations: list[str] = []
        self.pending: list[PendingCopy] = []
        self._raised = False

    def issued(self, new: PendingCopy) -> None:
        """Check ``new`` against every pending copy, then poison its destination."""
        with no_modes():
            self._issued(new)

    def _issued(self, new: PendingCopy) -> None:
        dst, src = _span(new.dst), _span(new.src)
        for old in self.pending:
            if ordered_before(old, new):
                if _overlap(_span(old.dst), dst):
                    new.dst_guarded = False  # (a slab reused after its copy: the earlier one writes it first)
                if _overlap(_span(old.dst), src):
                    new.src_guarded = False  # (a copy in of a slab whose copy out is still running)
                continue
            if _overlap(_span(old.dst), dst):
                self.violate(f"copy {new.name()} writes bytes that copy {old.name()} still writes, unordered")
            elif _overlap(_span(old.src), dst):
                self.violate(f"copy {new.name()} overwrites the source of copy {old.name()} before "
                             f"that copy is done")
            if _overlap(_span(old.dst), src):
                self.violate(f"copy {new.name()} reads the destination of copy {old.name()} before its event")
        new.dst.fill_(POISON)  # a read before the event sees NaNs, not the old bytes
        self.pending.append(new)

    def complete(self, c: PendingCopy) -> None:
        """The copy happens now: check what it reads and writes, then copy the bytes."""
        with no_modes():
            self._complete(c)

    def _complete(self, c: PendingCopy) -> None:
        name = c.name()
        if not _whole(c.src):
            if id(c.src) not in c.held:
                self.violate(f"the source of copy {name} was freed before the copy was done")
        elif not c.src_guarded:
            c.snapshot = clone(c.src)  # its bytes arrived since the issue, from the earlier copy
        elif not torch.equal(c.src, c.snapshot):
            if c.src_shared:  # a real copy would read some of each: whoever reads it gets NaNs
                c.snapshot.fill_(POISON)
            else:
                self.violate(f"the source of copy {name} changed before the copy was done")
        if not _whole(c.dst):
            if id(c.dst) not in c.held:
                self.violate(f"the destination of copy {name} was freed before the copy was done")
        else:
            if c.dst_guarded and not bool((c.dst == POISON).all()):
                self.violate(f"the destination of copy {name} was written before its event")
            c.dst.copy_(c.snapshot)
        self.pending.remove(c)

    def violate(self, message: str) -> None:
        """Recorded now, raised by ``raise_first`` once the engine's state is whole again."""
        self.violations.append(message)
        logger.error("copy rule broken: %s", message)

    def raise_first(self) -> None:
        if self.raise_on_violation and self.violations and not self._raised:
            self._raised = True
            raise CopyRuleViolation(self.violations[0])
