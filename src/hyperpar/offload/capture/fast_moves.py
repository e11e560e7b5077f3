"""The fast path for plans that move bytes: the plan's copies run at saved-tensor events.

Without the dispatch mode the only points a step shows are autograd's: ``pack`` when it
saves a tensor (forward, and recomputation in backward), ``unpack`` when a backward node
reads one. A checked replay of the plan logs where each of those events fell between its
ops (``EventLog``); ``MoveSchedule.build`` moves each of the plan's actions on a storage
to an event: copies out and releases to the first event at or after the plan's point (so
never before a forward op that reads the bytes), page-ins to the last event before it.

A release here is not ``resize_(0)``: a 0-byte storage read by a kernel that no mode
checks crashes the process, and without the mode nothing stops a step that departs from
its plan from reading one. ``pack`` hands autograd a handle instead of the tensor for a
storage the plan moves; the release drops the handle's slot's device reference (the host
copy stays), so the bytes are freed once Python lets go of them too, as ``save_on_cpu``
and torchtune's offloading free theirs. A storage Python still holds after its release
stays valid, on the device: the step counts it (``held_past_release``) and the plan stays
checked. ``unpack`` returns the original tensor while it lives, else a view of the slot's
paged-in storage (waiting for its copy, or paging in on demand).

A plan takes this path only when every storage it moves is one autograd saves, copied out
and released in forward and paged in during backward; otherwise ``build`` returns why not.
Known gap, shared with the peers: an in-place write to a saved tensor that Python then drops
cannot be seen at unpack (the version is checked while the tensor lives).
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from hyperpar.offload.capture.replay_program import (
    D2H,
    H2D,
    RELEASE,
    RELEASE_FINAL,
    RELEASE_HOST,
    ReplayProgram,
)
from hyperpar.offload.runtime.host_pool import ALIGN_BYTES as _ALIGN
from hyperpar.offload.runtime.host_pool import aligned
from hyperpar.offload.runtime.residency_manager import byte_view

Tensor = torch.Tensor
_inference = torch.is_inference_mode_enabled


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
    _backward: bool = False  # an unpack came
    _storages: dict[int, weakref.ref] = field(default_factory=dict)
    _tensors: dict[int, list[weakref.ref]] = field(default_factory=dict)

    def packed(self, slot: int, t: Tensor, storage: torch.UntypedStorage | None) -> None:
        if slot not in self.slot_sid:
            sid = -1 if storage is None else self.sid_of(storage)
            self.slot_sid[slot] = sid
            self.slot_bytes[slot] = self.size_of(sid) if sid >= 0 else 0
            if storage is not None:
                self._storages[slot] = weakref.ref(storage)
                self._tensors[slot] = []
        if slot in self._tensors:
            self._tensors[slot].append(weakref.ref(t))
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

    def _held_past_forward(self) -> frozenset[int]:
        """Slots whose storage more tensors reference than the saved ones (and their bases):
        Python (or a closure, or ``ctx``) holds it, so the fast path could not free it."""
        self.settle()
        held = []
        for slot, ref in self._storages.items():
            storage = ref()
            if storage is None or self.slot_sid[slot] < 0:
                continue
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
            del t
            # a tensor the saved ones do not explain holds the storage (one reference is the
            # storage object we hold here), or Python holds a saved tensor itself (beyond its
            # packs, ``ours`` and ``getrefcount``'s argument)
            if torch._C._storage_Use_Count(storage._cdata) - 1 > len(ours) or any(
                    n and sys.getrefcount(ours[k]) > n + 2 for k, n in packs.items()):
                held.append(slot)
        return frozenset(held)


@dataclass(frozen=True, slots=True)
class MoveSchedule:
    """The plan's actions by event: ``actions[e]`` are (code, slot) pairs run at event ``e``."""

    actions: dict[int, tuple[tuple[int, int], ...]]
    moved_slots: frozenset[int]
    slots: tuple[int, ...]  # each event's slot, as the checked replay saw it
    forward_end: int  # the first unpack event
    host_bytes: int  # the moved storages' bytes, as the checked replay measured them (aligned)
    slot_sid: dict[int, int]  # each moved slot's storage id in the plan
    planned: tuple[int, ...]  # the plan's most resident bytes from each event to the next
    backward_peak: int  # the most of them from forward's end on

    @classmethod
    def build(cls, log: EventLog, program: ReplayProgram) -> MoveSchedule | Refusal:
        """The schedule, or why this plan cannot run at saved-tensor events (and which
        storages it would have to keep on the device to run there)."""
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
            uses = [e for e in range(forward_end, n_events) if log.unpack[e] and log.slot[e] == slot]
            if uses:
                actions.setdefault(max(uses[0] - 1, forward_end), []).append((H2D, slot))
                if uses[-1] + 1 < n_events:
                    actions.setdefault(uses[-1] + 1, []).append((RELEASE, slot))
        if bad:
            sid, why = next(iter(bad.items()))
            held = {log.slot_sid[slot] for slot in log.held} - {-1}  # a re-plan must not move these either
            return Refusal(f"{len(bad)} moved storage(s) cannot move at saved-tensor events "
                           f"(storage {sid}: {why})", frozenset(bad) | frozenset(held))
        moved = frozenset(slot_of[s] for s in program.moved)
        planned = _ahead(np.asarray(program.planned_resident, dtype=np.int64), clock)
        return cls({e: tuple(a) for e, a in actions.items()}, moved, tuple(log.slot), forward_end,
                   sum(aligned(log.slot_bytes[slot]) for slot in moved),
                   {slot_of[s]: s for s in program.moved},
                   planned, max(planned[forward_end:], default=0))


def _ahead(resident: np.ndarray, clock: np.ndarray) -> tuple[int, ...]:
    """Per event: the most the plan holds from the op before it up to the op before the next
    event, so a check at an event covers the ops it lets run."""
    if not len(resident) or not len(clock):
        return tuple(0 for _ in clock)
    start = np.clip(clock - 1, 0, len(resident) - 1)
    seg = np.maximum.reduceat(resident, start)
    end = np.append(start[1:], len(resident) - 1)
    return tuple(np.maximum(seg, resident[end]).tolist())


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why a plan cannot take the fast path, and the storages it would have to keep."""

    why: str
    sids: frozenset[int]


def checked_version(t: Tensor, version: int) -> Tensor:
    """Autograd's in-place check (it skips its own for tensors saved through hooks), in its words."""
    if t._version != version:
        raise RuntimeError(
            f"one of the variables needed for gradient computation has been modified by an inplace "
            f"operation: [{t.type()} {list(t.shape)}] is at version {t._version}; expected version "
            f"{version} instead. Hint: enable anomaly detection to find the operation that failed to "
            f"compute its gradient, with torch.autograd.set_detect_anomaly(True).")
    return t


class _Slot:
    """One storage the plan moves: its device bytes (the original, then a paged-in copy, or
    None), its host copy, the copies' events, and the last tensor rebuilt from it."""

    __slots__ = ("d2h", "device", "h2d", "host", "nbytes", "original", "view", "view_key")

    def __init__(self, storage: torch.UntypedStorage) -> None:
        self.device: torch.UntypedStorage | None = storage
        self.original = weakref.ref(storage)
        self.nbytes = storage.nbytes()
        self.host: Tensor | None = None
        self.d2h: Any = None
        self.h2d: Any = None
        self.view: Tensor | None = None
        self.view_key: tuple[Any, ...] | None = None


class MovingStep:
    """A fast step's moves: ``pack``/``unpack`` bodies for the saved tensors of moved storages.

    Host copies go to one pool slab for the step, cut in order (``schedule.host_bytes``, as
    the checked replay's storages measured; a storage past it takes a slab of its own). A
    storage two saved tensors view the same way is rebuilt once per page-in."""

    def __init__(self, schedule: MoveSchedule, engine: Any, pool: Any, device: torch.device,
                 budget_bytes: int) -> None:
        self.schedule = schedule
        self.budget_bytes = budget_bytes
        self._actions = schedule.actions
        self._moved = schedule.moved_slots
        self.engine, self.pool, self.device = engine, pool, device
        self.slots: dict[int, _Slot] = {}
        self.event = 0
        self.on_plan = True  # events still match the checked replay's (else: demand only)
        self.bytes_d2h = self.bytes_h2d = self.demand_faults = 0
        self.held_past_release = 0  # bytes released that Python still held when forward ended
        self.held_sids: frozenset[int] = frozenset()  # their storage ids in the plan
        # told when a storage released in forward is still alive an event later (Python
        # holds it): the step cannot keep the plan's budget without the dispatch mode
        self.on_held: Callable[[str], None] | None = None
        self._held: list[tuple[int, _Slot]] = []  # released while Python held them, still to die
        self.worst = 0  # the most the plan's resident bytes plus held ones reached at an event
        self._slab: Tensor | None = None  # the step's host slab, cut from ``_cut`` on
        self._slab_after: Any = None  # the last copy that used the slab's memory before
        self._slab_bytes = 0
        self._cut = 0
        self._own: list[Tensor] = []  # slabs of storages past the step's slab

    def pack(self, t: Tensor, slot: int, version: int, shape: Any, dtype: torch.dtype,
             offset: int) -> tuple[Any, ...]:
        e = self.event
        self.event = e + 1
        s = None
        if slot in self._moved:
            s = self.slots.get(slot)
            if s is None:
                s = self.slots[slot] = _Slot(t.untyped_storage())
        if self.on_plan:
            if self._held:
                self._check_held(e)
            acts = self._actions.get(e)
            if acts is not None:
                self._run(acts, e)
        if s is None:
            return t, version, slot
        return weakref.ref(t), version, slot, s, (offset, shape, t.stride(), dtype)

    def unpack(self, packed: tuple[Any, ...]) -> Tensor:
        e = self.event
        self.event = e + 1
        slot = packed[2]
        if self.on_plan:
            if e == self.schedule.forward_end:
                self._forward_ended()
            if self._held:
                self._check_held(e)
            if e >= len(self.schedule.slots) or self.schedule.slots[e] != slot:
                self.on_plan = False  # backward runs otherwise than the plan's: page in on demand
            else:
                acts = self._actions.get(e)
                if acts is not None:
                    self._run(acts, e)
        if len(packed) == 3:
            t, version = packed[0], packed[1]
        else:
            t, version = packed[0](), packed[1]
            if t is None:
                return self._rebuilt(packed[3], packed[4])
        return checked_version(t, version)

    def _rebuilt(self, s: _Slot, key: tuple[Any, ...]) -> Tensor:
        storage = s.device
        if storage is None:
            storage = self._page_in(s)
            self.demand_faults += 1
        if s.h2d is not None:
            self.engine.wait(s.h2d)
            s.h2d = None
        if s.view is not None and s.view_key == key:
            return s.view
        offset, shape, stride, dtype = key
        view = torch.empty(0, dtype=dtype, device=storage.device).set_(storage, offset, shape, stride)
        if self.on_plan:  # the plan's release lets go of it
            s.view, s.view_key = view, key
        elif s.host is not None:  # off the plan nothing releases: the view alone keeps the bytes
            s.device = s.view = None
        return view

    def _check_held(self, e: int) -> None:
        """Storages released while Python held them keep their bytes on the device until it
        lets go (a layer's input the caller holds until the layer returns): at event ``e``
        the plan's resident bytes plus those must still fit the budget. In forward, a step
        they do not fit in goes on with the dispatch mode (``on_held``), which can evict them."""
        held = self._held = [(slot, s) for slot, s in self._held if s.original() is not None]
        if not held:
            return
        schedule = self.schedule
        # at forward's last saved tensor, what is still held will most likely be held through
        # backward: it must fit beside the plan's bytes there too
        planned = schedule.planned[e] if e != schedule.forward_end - 1 else max(
            schedule.planned[e], schedule.backward_peak)
        resident = planned + sum(s.nbytes for _, s in held)
        if resident > self.budget_bytes and self._settle(held):  # copies still reading some: done now
            held = self._held = [(slot, s) for slot, s in held if s.original() is not None]
            resident = planned + sum(s.nbytes for _, s in held)
        if resident > self.worst:
            self.worst = resident
        if resident > self.budget_bytes and e < self.schedule.forward_end:
            self.held_past_release = sum(s.nbytes for _, s in held)
            self.held_sids = frozenset(self.schedule.slot_sid[slot] for slot, _ in held)
            if self.on_held is not None:
                self.on_held(f"{len(held)} storage(s) the plan released are still held by Python, over the "
                             f"budget (storage {self.schedule.slot_sid[held[0][0]]} first)")

    def _settle(self, held: list[tuple[int, _Slot]]) -> bool:
        """Wait for the copies out of these storages: a copy in flight keeps its source alive
        (as the residency manager's pending frees do), which is not Python holding it.
        True: look again."""
        for _, s in held:
            if s.d2h is not None and not self.engine.is_done(s.d2h):
                self.engine.finish(s.d2h)
        self.engine.poll()  # finished copies let go of their tensors here
        return True

    def _run(self, acts: tuple[tuple[int, int], ...], e: int) -> None:
        slots = self.slots
        out = False
        for code, slot in acts:
            s = slots.get(slot)
            if s is None:
                continue
            if code == D2H:
                self._copy_out(s, slot)
                out = True
            elif code == H2D:
                if s.device is None and s.host is not None:
                    self._page_in(s)
            elif s.host is not None:  # a release: only with a host copy
                s.device = s.view = None
                out = True
                if s.original() is not None:
                    self._held.append((slot, s))
        if out:  # finished copies out let go of their sources (released storages) here
            self.engine.poll()

    def _host(self, nbytes: int) -> tuple[Tensor, Any] | None:
        """Host bytes for a copy out, and the copy they must wait for."""
        if self._slab is None and not self._own:
            got = self.pool.acquire_with_event(max(self.schedule.host_bytes, 1))
            if got is not None:
                self._slab, self._slab_after = got
                self._slab_bytes = got[0].numel()
        slab, cut = self._slab, self._cut
        if slab is not None and cut + nbytes <= self._slab_bytes:
            self._cut = cut + (nbytes + _ALIGN - 1) // _ALIGN * _ALIGN  # ``host_pool.aligned``, inline
            after = self._slab_after
            if after is not None and self.engine.is_done(after):
                after = self._slab_after = None
            return slab[cut:cut + nbytes], after
        got = self.pool.acquire_with_event(nbytes)
        if got is None:
            return None
        self._own.append(got[0])
        return got[0][:nbytes], got[1]

    def _copy_out(self, s: _Slot, slot: int) -> None:
        storage = s.device
        if storage is None or s.host is not None:
            return
        got = self._host(s.nbytes)
        if got is None:  # the host pool's cap: the storage stays on the device
            return
        s.host, after = got
        # ``byte_view``, inline where no inference mode makes the view an inference tensor
        src = (byte_view(storage) if _inference() else
               torch.empty(0, dtype=torch.uint8, device=self.device).set_(storage))
        s.d2h = self.engine.copy_d2h(s.host, src, after, slot)
        self.bytes_d2h += s.nbytes

    def _page_in(self, s: _Slot) -> torch.UntypedStorage:
        assert s.host is not None
        dst = torch.empty(s.nbytes, dtype=torch.uint8, device=self.device)
        after = s.d2h if s.d2h is not None and not self.engine.is_done(s.d2h) else None
        s.h2d = self.engine.copy_h2d(dst, s.host, after, -1)
        s.device = storage = dst.untyped_storage()
        self.bytes_h2d += s.nbytes
        return storage

    def _forward_ended(self) -> None:
        """What forward released that Python still holds (at the first unpack, or the step's
        end): kept on the device through backward, past the plan."""
        released = [(slot, s) for slot, s in self.slots.items()
                    if s.device is None and s.original() is not None]
        self._settle(released)
        held = [(slot, s.nbytes) for slot, s in released if s.original() is not None]
        self.held_past_release = sum(n for _, n in held)
        self.held_sids = frozenset(self.schedule.slot_sid[slot] for slot, _ in held)

    def finish(self) -> None:
        """At the step's end: a slot whose handles outlive the step (a graph kept for later)
        gets its bytes back on the device; the host slabs go back to the pool."""
        if self.on_plan and self.event <= self.schedule.forward_end:
            self._forward_ended()  # no backward ran in the step
        slots = list(self.slots.values())
        self.slots.clear()
        while slots:
            s = slots.pop()
            if s.host is not None and s.device is None and sys.getrefcount(s) > _UNHELD:
                self._page_in(s)  # a handle still holds it
            s.host = None
        self.engine.synchronize()
        if self._slab is not None:
            self.pool.release(self._slab, None)
            self._slab = None
        for slab in self._own:
            self.pool.release(slab, None)
        self._own.clear()


_UNHELD = 2  # ``sys.getrefcount`` of a slot only ``finish``'s local name holds (and the call's argument)
