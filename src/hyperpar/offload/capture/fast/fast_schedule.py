"""Where a plan's moves happen on the fast path: at autograd's saved-tensor events.

A checked replay of a plan that moves bytes logs where each ``pack`` and ``unpack`` fell
between its ops (``EventLog``); ``MoveSchedule.build`` moves each of the plan's actions on a
storage to an event: copies out and releases to the first event at or after the plan's point
(so never before a forward op that reads the bytes), page-ins to the last event before it and
before the unpack the plan's reads follow. A plan takes the fast path only when every storage
it moves is one autograd saves and nothing else holds past forward, copied out and released in
forward and paged in during backward; otherwise ``build`` returns a ``Refusal`` naming the
storages a re-plan must keep on the device. ``capture.fast.fast_moves`` runs the schedule.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch

from hyperpar.offload.capture.checked.replay_program import (
    D2H,
    H2D,
    RELEASE,
    RELEASE_FINAL,
    RELEASE_HOST,
    ReplayProgram,
)
from hyperpar.offload.runtime.host_pool import aligned

Tensor = torch.Tensor


@dataclass(slots=True)
class EventLog:
    """What a checked replay's saved-tensor events were: per event, whether it was an unpack,
    the ops the step had run when it came (``clock``), and the saved tensor's slot; per
    slot, the plan's storage id (-1: not an activation) and size; and, at forward's end,
    which slots' storages something other than autograd's saved tensors still holds."""

    clock_of: Callable[[], int]
    sid_of: Callable[[torch.UntypedStorage], int]
    size_of: Callable[[int], int]
    settle: Callable[[], None]  # lets every copy finish and drop its tensors (they hold storages)
    unpack: list[bool] = field(default_factory=list)
    clock: list[int] = field(default_factory=list)
    slot: list[int] = field(default_factory=list)
    slot_sid: dict[int, int] = field(default_factory=dict)
    slot_bytes: dict[int, int] = field(default_factory=dict)
    held: frozenset[int] = frozenset()  # slots held past forward by more than the saved tensors
    # slot -> the first and last forward event at which something beyond the saved tensors
    # held its storage (``watch``): past its release the fast path cannot free those bytes
    held_at: dict[int, tuple[int, int]] = field(default_factory=dict)
    watch: bool = False
    _backward: bool = False  # an unpack came
    _storages: dict[int, weakref.ref] = field(default_factory=dict)
    _watching: dict[int, weakref.ref] = field(default_factory=dict)  # slots Python held when last looked
    _tensors: dict[int, list[weakref.ref]] = field(default_factory=dict)

    def packed(self, slot: int, t: Tensor, storage: torch.UntypedStorage | None) -> None:
        if slot not in self.slot_sid:
            sid = -1 if storage is None else self.sid_of(storage)
            self.slot_sid[slot] = sid
            self.slot_bytes[slot] = self.size_of(sid) if sid >= 0 else 0
            if storage is not None:
                self._storages[slot] = self._watching[slot] = weakref.ref(storage)
                self._tensors[slot] = []
        if slot in self._tensors:
            self._tensors[slot].append(weakref.ref(t))
        if self.watch:
            self._watch_held()
        self.unpack.append(False)
        self.clock.append(self.clock_of())
        self.slot.append(slot)

    def unpacked(self, slot: int) -> None:
        if not self._backward:
            self._backward = True
            self.held = self._held_past_forward()
        self.unpack.append(True)
        self.clock.append(self.clock_of())
        self.slot.append(slot)

    def frozen(self) -> EventLog:
        """What was logged, without the step it was logged from (nothing more can be logged):
        a plan keeps it to place a re-plan's moves on the same events."""
        return replace(self, clock_of=_logged, sid_of=_logged, size_of=_logged, settle=_logged,
                       unpack=list(self.unpack), clock=list(self.clock), slot=list(self.slot),
                       slot_sid=dict(self.slot_sid), slot_bytes=dict(self.slot_bytes),
                       held_at=dict(self.held_at), watch=False, _backward=True, _storages={}, _tensors={},
                       _watching={})

    def unmovable(self, sids: frozenset[int]) -> frozenset[int]:
        """Of ``sids``, the storages the fast path can never move: those no saved tensor held
        in forward (it sees no event of theirs there: backward's own, or a rebuilt call's saved
        in backward), and those Python held past forward (it cannot free them).
        A plan with these pinned is the fast path's best; its floor is the fast-path floor."""
        first_unpack = next((e for e, u in enumerate(self.unpack) if u), len(self.unpack))
        forward = set(self.slot[:first_unpack])  # saved in backward (a rebuilt call): not movable there
        saved = {sid for slot, sid in self.slot_sid.items() if sid >= 0 and slot in forward}
        return frozenset(sids - saved) | (frozenset(self.slot_sid[slot] for slot in self.held) & sids)

    def backward_op(self) -> int | None:
        """The op backward began at (the ops run when the first unpack came), or None."""
        return next((self.clock[e] for e, unpack in enumerate(self.unpack) if unpack), None)

    def held_reads(self, movable: frozenset[int]) -> tuple[np.ndarray, np.ndarray]:
        """Per op and storage (of ``movable``): where Python held it in forward, as reads a
        plan must respect (ops, sids): the fast path cannot free it there, so a plan that
        releases it only after the span runs fast where one releasing it inside falls back."""
        ops: list[np.ndarray] = []
        sids: list[int] = []
        clock = self.clock
        for slot, (first, last) in self.held_at.items():
            sid = self.slot_sid[slot]
            if sid not in movable:
                continue
            span = np.arange(max(clock[first] - 1, 0), max(clock[last], clock[first]), dtype=np.int64)
            ops.append(span)
            sids.extend([sid] * len(span))
        if not ops:
            return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
        return np.concatenate(ops), np.asarray(sids, dtype=np.int64)

    def _watch_held(self) -> None:
        """At a forward event: which saved storages Python holds beyond the saved tensors (the
        copies still reading them finish first: they hold them too). Only the storages Python
        held when last looked are looked at again (and each new one): once let go, a storage is
        rarely taken up again, and looking at every storage at every event cost O(events x
        storages), 7 s of a 19k-op step's first checked replay. A storage taken up again later
        is still caught by the fast step itself, which then falls back and plans it kept."""
        self.settle()
        e = len(self.clock)
        gone = []
        for slot, ref in self._watching.items():
            storage = ref()
            if storage is not None and self.slot_sid[slot] >= 0 and self._python_holds(slot, storage, True):
                self.held_at[slot] = (self.held_at.get(slot, (e, e))[0], e)
            else:
                gone.append(slot)
        for slot in gone:
            del self._watching[slot]

    def _held_past_forward(self) -> frozenset[int]:
        """Slots whose storage more tensors reference than the saved ones (and their bases):
        Python (or a closure, or ``ctx``) holds it, so the fast path could not free it."""
        self.settle()
        held = []
        for slot, ref in self._storages.items():
            storage = ref()
            if storage is None or self.slot_sid[slot] < 0:
                continue
            if self._python_holds(slot, storage):
                held.append(slot)
        return frozenset(held)

    def _python_holds(self, slot: int, storage: torch.UntypedStorage, bases: bool = False) -> bool:
        """Whether a tensor the saved ones do not explain holds the storage (one reference is
        its storage object), or Python holds a saved tensor itself (beyond its packs, ``ours``
        and ``getrefcount``'s argument), or with ``bases`` the base of a saved view (beyond
        ``ours``, the argument and the reference torch keeps for a tensor only C++ holds: a
        key/value cache keeps the base whose view attention saved). Copies still reading it
        must have let go first."""
        ours: dict[int, Tensor] = {}
        packs: dict[int, int] = {}  # tensor object -> packs of it (each packed tuple refers to it)
        for tref in self._tensors[slot]:
            t = tref()
            if t is not None:
                ours[id(t)] = t
                packs[id(t)] = packs.get(id(t), 0) + 1
                base = t._base
                if base is not None and id(base) not in ours:
                    ours[id(base)] = base
                    packs.setdefault(id(base), 0)
        t = base = None
        return torch._C._storage_Use_Count(storage._cdata) - 1 > len(ours) or any(
            sys.getrefcount(ours[k]) > n + 2 if n else bases and sys.getrefcount(ours[k]) > 3
            for k, n in packs.items())


def _logged(*_: Any) -> Any:
    raise RuntimeError("a frozen event log logs nothing more")


@dataclass(frozen=True, slots=True)
class MoveSchedule:
    """The plan's actions by event: ``actions[e]`` are (code, slot) pairs run at event ``e``."""

    actions: dict[int, tuple[tuple[int, int], ...]]
    moved_slots: frozenset[int]
    slots: tuple[int, ...]  # each event's slot, as the checked replay saw it
    forward_end: int  # the first unpack event
    host_bytes: int  # the moved storages' bytes, as the checked replay measured them (aligned)
    slot_sid: dict[int, int]  # each moved slot's storage id in the plan
    slot_bytes: dict[int, int]  # each moved slot's size, as the checked replay measured it
    # the plan's most resident bytes from each event to the next; at forward's last event,
    # backward's peak too: what Python still holds there will most likely be held through
    # backward, beside the plan's bytes (what storages held past their release must fit by)
    planned: tuple[int, ...]

    @classmethod
    def build(cls, log: EventLog, program: ReplayProgram, budget_bytes: int | None = None
              ) -> MoveSchedule | Refusal:
        """The schedule, or why this plan cannot run at saved-tensor events (and which
        storages it would have to keep on the device to run there). With ``budget_bytes``,
        storages Python held past the plan's release in the logged step are refused where
        the fast path, which cannot free them while held, would hold more than the budget:
        the step would fall back to the dispatch mode."""
        n_events = len(log.clock)
        clock = np.asarray(log.clock, dtype=np.int64)
        unpacks = np.flatnonzero(np.asarray(log.unpack, dtype=bool))
        forward_end = int(unpacks[0]) if len(unpacks) else n_events
        slot_of: dict[int, int] = {}
        for slot, sid in log.slot_sid.items():
            if sid >= 0:
                slot_of.setdefault(sid, slot)
        bad = {sid: "no saved tensor holds it" for sid in sorted(program.moved - slot_of.keys())}
        for slot in log.held:
            sid = log.slot_sid[slot]
            if sid in program.moved and slot_of.get(sid) == slot:
                bad.setdefault(sid, "Python holds it past forward")
        planned = _ahead(np.asarray(program.planned_resident, dtype=np.int64), clock, forward_end)
        slots_arr = np.asarray(log.slot, dtype=np.int64)
        unpacks_of = {int(slot): unpacks[slots_arr[unpacks] == slot]
                      for slot in np.unique(slots_arr[unpacks])}
        first_pack: dict[int, int] = {}
        for e in range(forward_end):
            first_pack.setdefault(log.slot[e], e)
        actions: dict[int, list[tuple[int, int]]] = {}
        copied_at: dict[int, int] = {}
        released: dict[int, bool] = {}
        paged: set[int] = set()
        for j in np.flatnonzero(np.diff(np.asarray(program.act_start, dtype=np.int64))).tolist():
            point = j // 2 + (j & 1)  # op i's pre list runs before op i, its post list after
            for code, sid in program.actions(j):
                if code == RELEASE_HOST or sid in bad:  # host slabs go back when the step ends
                    continue
                slot = slot_of[sid]
                if code == H2D:
                    e = int(np.searchsorted(clock, point, "left")) - 1
                    # a backward node unpacks all it saved before its first op: the page-in
                    # must come before the unpack of this storage that the plan's reads follow
                    u = unpacks_of.get(slot)
                    if u is not None:
                        k = int(np.searchsorted(clock[u], point, "right")) - 1
                        if k >= 0 and e >= u[k]:
                            e = int(u[k]) - 1
                    if e < forward_end:
                        bad[sid] = "the plan pages it back in during forward"
                else:
                    e = max(int(np.searchsorted(clock, point, "left")), first_pack.get(slot, n_events))
                    if code == D2H:
                        if e >= forward_end:
                            bad[sid] = "the plan copies it out after forward"
                        elif slot in copied_at:  # written in between: the first copy went stale
                            bad[sid] = "the plan copies it out twice"
                        copied_at[slot] = e
                    elif code in (RELEASE, RELEASE_FINAL):
                        if slot not in copied_at:
                            bad[sid] = "the plan releases it before copying it out"
                        e = max(e, copied_at.get(slot, e))
                        if copied_at.get(slot, n_events) < forward_end <= e and not released.get(slot):
                            # dropping our reference early never hurts a read (Python's own
                            # references keep the bytes), and forward's end sees it held or gone
                            e = forward_end - 1
                        released[slot] = True
                if e < n_events and sid not in bad:
                    actions.setdefault(e, []).append((code, slot))
                    if code == H2D:
                        paged.add(slot)
        # A storage the plan lets go of for good in forward may still be unpacked in backward
        # (a backward that reads only its shape): the fast path must rebuild it, so it pages it
        # in an event ahead and lets go after its last unpack.
        for slot in {slot_of[sid] for sid in program.moved if sid not in bad} - paged:
            uses = unpacks_of.get(slot)
            if uses is not None:
                actions.setdefault(max(int(uses[0]) - 1, forward_end), []).append((H2D, slot))
                if uses[-1] + 1 < n_events:
                    actions.setdefault(int(uses[-1]) + 1, []).append((RELEASE, slot))
        advisory = False
        if budget_bytes is not None and log.held_at and not bad:
            bad.update(_held_over_budget(log, actions, planned, forward_end, budget_bytes))
            advisory = bool(bad)
        if bad:
            sid, why = next(iter(bad.items()))
            held = {log.slot_sid[slot] for slot in log.held} - {-1}  # a re-plan must not move these either
            return Refusal(f"{len(bad)} moved storage(s) cannot move at saved-tensor events "
                           f"(storage {sid}: {why})", frozenset(bad) | frozenset(held), advisory)
        moved = frozenset(slot_of[s] for s in program.moved)
        return cls({e: tuple(a) for e, a in actions.items()}, moved, tuple(log.slot), forward_end,
                   sum(aligned(log.slot_bytes[slot]) for slot in moved),
                   {slot_of[s]: s for s in program.moved}, {slot: log.slot_bytes[slot] for slot in moved},
                   planned)


def _held_over_budget(log: EventLog, actions: dict[int, list[tuple[int, int]]], planned: tuple[int, ...],
                      forward_end: int, budget_bytes: int) -> dict[int, str]:
    """The storages the fast path would find Python holding after their release in forward
    (as the logged step held them), where the plan's bytes plus theirs exceed the budget: the
    fast step would fall back to the dispatch mode there, so they are kept instead."""
    released = {slot: e for e, acts in actions.items() for code, slot in acts
                if code in (RELEASE, RELEASE_FINAL) and e < forward_end}
    extra = np.zeros(forward_end, dtype=np.int64)
    spans = []
    for slot, (first, last) in log.held_at.items():
        r = released.get(slot)
        # (the fast path looks at what is held before an event's actions: from the next one on)
        if r is not None and max(first, r + 1) <= last:
            extra[max(first, r + 1):last + 1] += log.slot_bytes[slot]
            spans.append((log.slot_sid[slot], max(first, r + 1), last))
    if not spans:
        return {}
    over = np.flatnonzero(np.asarray(planned[:forward_end], dtype=np.int64) + extra > budget_bytes)
    # the ones held at an event over the budget, as the fast step would find them there
    return {sid: "Python holds it past its release, over the budget" for sid, a, b in spans
            if bool(((over >= a) & (over <= b)).any())}


def _ahead(resident: np.ndarray, clock: np.ndarray, forward_end: int) -> tuple[int, ...]:
    """Per event: the most the plan holds from the op before it up to the op before the next
    event, so a check at an event covers the ops it lets run; at forward's last event, the
    most it holds in backward too."""
    if not len(resident) or not len(clock):
        return tuple(0 for _ in clock)
    start = np.clip(clock - 1, 0, len(resident) - 1)
    seg = np.maximum.reduceat(resident, start)
    end = np.append(start[1:], len(resident) - 1)
    ahead = np.maximum(seg, resident[end])
    if 0 < forward_end < len(ahead):
        ahead[forward_end - 1] = max(ahead[forward_end - 1], ahead[forward_end:].max())
    return tuple(ahead.tolist())


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why a plan cannot take the fast path, and the storages it would have to keep."""

    why: str
    sids: frozenset[int]
    # only storages Python held past their release over the budget in the logged step: the
    # plan can still run fast, at the cost of a fallback where a step holds them that way
    advisory: bool = False
