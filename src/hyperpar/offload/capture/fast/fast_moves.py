"""The fast path for plans that move bytes: the plan's copies run at saved-tensor events
(``capture.fast.fast_schedule`` says which, from a checked replay of the plan).

A release here is not ``resize_(0)``: a 0-byte storage read by a kernel that no mode
checks crashes the process, and without the mode nothing stops a step that departs from
its plan from reading one. ``pack`` hands autograd a handle instead of the tensor for a
storage the plan moves; the release drops the handle's slot's device reference (the host
copy stays), so the bytes are freed once Python lets go of them too, as ``save_on_cpu``
and torchtune's offloading free theirs.

**The live bytes win.** While anything still holds the user's storage (a variable, a
``.detach()``, ``.data`` or ``.numpy()`` alias, a view), unpack reads it rather than the
host copy, which a write through the alias may have made stale. Where the plan's bytes plus
storages Python holds past their release no longer fit the budget, the step goes on with
the dispatch mode (``on_held``) and the session plans again with them kept. A handle keeps
the saved tensor's version counter (``saved_versions.version_keeper``), so a write through
the tensor, a view or a ``.detach()`` alias raises at unpack as plain autograd does, even
after Python dropped them.

``.data`` shares the bytes and no counter (no error in plain PyTorch either): the session's
``Tensor.data`` tells the step (``unversioned``), and such a storage's final bytes are copied
out again when the slot lets go of it. Not seen without the dispatch mode: a write through
raw memory (``.numpy()``, DLPack, ``data_ptr``) after the copy out, by an alias gone before
backward reads the tensor (a kept one is read live).
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Callable
from typing import Any

import torch

from hyperpar.offload.capture.checked.replay_program import D2H, H2D
from hyperpar.offload.capture.fast.fast_schedule import MoveSchedule
from hyperpar.offload.capture.fast.move_slot import MoveSlot
from hyperpar.offload.capture.fast.saved_versions import checked_version, version_keeper
from hyperpar.offload.runtime.disk_tier import DiskTier
from hyperpar.offload.runtime.host_pool import aligned
from hyperpar.offload.runtime.residency_manager import byte_view

Tensor = torch.Tensor


class MovingStep:
    """A fast step's moves: ``pack``/``unpack`` bodies for the saved tensors of moved storages.

    Host copies go to one pool slab for the step, cut in order (``schedule.host_bytes``, as
    the checked replay's storages measured; a storage past it takes a slab of its own). A
    storage two saved tensors view the same way is rebuilt once per page-in."""

    def __init__(self, schedule: MoveSchedule, engine: Any, pool: Any, device: torch.device,
                 budget_bytes: int, tier: DiskTier | None = None) -> None:
        self.schedule = schedule
        # a host budget: each copy takes a slab of its own through the disk tier, which may
        # write it to disk once released and read it back (not the step's one slab)
        self.tier = tier
        self.budget_bytes = budget_bytes
        self._actions = schedule.actions
        self._moved = schedule.moved_slots
        self._slot_bytes = schedule.slot_bytes
        self.engine, self.pool, self.device = engine, pool, device
        self._empty = torch.empty(0, device=device)  # what version keepers hold instead of bytes
        # an engine that checks what its copies read is told that the user may write these
        self._shared = getattr(engine, "source_may_change", None)
        self.slots: dict[int, MoveSlot] = {}
        self.event = 0
        self.on_plan = True  # events still match the checked replay's (else: demand only)
        self.bytes_d2h = self.bytes_h2d = self.demand_faults = 0
        self.held_past_release = 0  # bytes released that Python still held when forward ended
        self.held_sids: frozenset[int] = frozenset()  # their storage ids in the plan
        # told when the step cannot keep the plan's budget without the dispatch mode: a storage
        # released in forward is still alive an event later (Python holds it), or a storage
        # is larger than the plan's
        self.on_held: Callable[[str], None] | None = None
        # storages a ``.data`` alias was taken of in this step (by id, weakly)
        self._unversioned: dict[int, weakref.ref] = {}
        self.mode_evicts = False  # after a departure: the fallback's dispatch mode may evict
        self._held: list[tuple[int, MoveSlot]] = []  # released while Python held them, still to die
        # their bytes, counted when released: dead ones stay counted until a look that may
        # change something (the plan's bytes plus this reaching ``worst``) drops them
        self._held_bytes = 0
        self.worst = 0  # the most the plan's resident bytes plus held ones reached at an event
        self._slab: Tensor | None = None  # the step's host slab, cut from ``_cut`` on
        self._slab_after: Any = None  # the last copy that used the slab's memory before
        self._slab_bytes = 0
        self._cut = 0
        self._own: list[Tensor] = []  # slabs of storages past the step's slab
        # paged-in copies -> their slot: where a checked replay pages a storage back in place,
        # this path makes a new one, which a call rebuilt in backward saves again (the same slot)
        self._paged: dict[int, tuple[int, weakref.ref]] = {}

    def pack(self, t: Tensor, slot: int, version: int, shape: Any, dtype: torch.dtype,
             offset: int) -> tuple[Any, ...]:
        e = self.event
        self.event = e + 1
        s = None
        if slot in self._moved:
            s = self.slots.get(slot)
            if s is None:
                s = MoveSlot(t.untyped_storage(), self.schedule.slot_sid[slot])
                if s.nbytes > self._slot_bytes[slot] and self.on_plan:
                    # larger than the plan's (a step its saved tensors cover in shape, with
                    # a larger base): the plan's bytes no longer bound the step's
                    self.on_plan = False
                    if self.on_held is not None:
                        self._settle()
                        self.on_held(f"storage {self.schedule.slot_sid[slot]} is {s.nbytes} bytes, "
                                     f"the plan's {self._slot_bytes[slot]}")
                    return t, version, slot
                self.slots[slot] = s
        if self.on_plan:
            if self._held:
                self._check_held(e)
            acts = self._actions.get(e)
            if acts is not None:
                self._run(acts, e)
        if s is None:
            return t, version, slot
        # the keeper: the version counter outlives the tensor, as autograd's saved one does
        keeper = version_keeper(t, self._empty)
        return weakref.ref(t), version, slot, s, (offset, shape, t.stride(), dtype), keeper

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
        elif self._held:  # off the plan: storages Python let go of still leave the device
            self._alive_held()
        if len(packed) == 3:
            t, version = packed[0], packed[1]
        else:
            t, version = packed[0](), packed[1]
            if t is None:
                key = packed[4]
                checked_version(packed[5], version, key[1])  # written through a view or alias since
                return self._rebuilt(packed[3], slot, key)
        return checked_version(t, version)

    def _rebuilt(self, s: MoveSlot, slot: int, key: tuple[Any, ...]) -> Tensor:
        """The saved tensor, from the user's storage while anything holds it (its live bytes:
        an alias may have written it since the copy out), else from the slot's paged-in copy
        (paged in now if the plan did not)."""
        storage = s.live(self.mode_evicts and self._is_unversioned(s.original()))
        if storage is None:
            storage = s.device
        if storage is None:
            storage = self._page_in(s, slot)
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
        elif self._has_copy(s):  # off the plan nothing releases: the view alone keeps the bytes
            s.view = None
            if s.device is not s.original():
                s.device = None
                if self.tier is not None:
                    self.tier.evicted(s)  # its host copy is the slot's only one now: keep it
            elif all(h is not s for _, h in self._held):  # the user's: let go once nothing else holds it
                self._held.append((slot, s))
        return view

    def _check_held(self, e: int) -> None:
        """Storages released while Python held them keep their bytes on the device until it
        lets go (a layer's input the caller holds until the layer returns): at event ``e``
        the plan's resident bytes plus those must still fit the budget. In forward, a step
        they do not fit in goes on with the dispatch mode (``on_held``), which can evict them."""
        planned = self.schedule.planned[e]  # (at forward's last saved tensor, backward's peak too)
        if planned + self._held_bytes <= self.worst:
            # the count is at least what is still held: nothing can be over ``worst`` (which
            # is within the budget while the step is on its plan in forward), so no look
            return
        held = self._alive_held()
        if not held:
            return
        resident = planned + self._held_bytes
        if resident > self.worst:
            self.worst = resident
        if resident > self.budget_bytes and e < self.schedule.forward_end:
            self.held_past_release = self._held_bytes
            self.held_sids = frozenset(self.schedule.slot_sid[slot] for slot, _ in held)
            if self.on_held is not None:
                self._settle()
                self.on_held(f"{len(held)} storage(s) the plan released are still held by Python, over the "
                             f"budget (storage {self.schedule.slot_sid[held[0][0]]} first)")

    def _alive_held(self) -> list[tuple[int, MoveSlot]]:
        """``_held`` without the storages nothing else holds any more (``_let_go``), and
        ``_held_bytes`` exact again."""
        held = []
        for slot, s in self._held:
            if s.held_elsewhere():
                held.append((slot, s))
            else:
                self._let_go(s, slot)
        self._held = held
        self._held_bytes = sum(s.nbytes for _, s in held)
        return held

    def _settle(self) -> None:
        """Before the dispatch mode takes over: the copies out still reading released storages
        finish, so those storages are gone rather than bound as the mode's activations."""
        engine = self.engine
        for s in self.slots.values():
            if s.device is None and s.d2h is not None and not engine.is_done(s.d2h):
                engine.finish(s.d2h)
        engine.poll()  # finished copies let go of their sources here

    def unversioned(self, t: Tensor) -> None:
        """``t.data`` was taken: its storage may be written without a version from now on. A
        released storage of the plan's that Python still holds is kept by its slot from now
        on, so its final bytes can go out again when Python lets go (``_let_go``)."""
        try:
            st = t.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return
        self._unversioned[id(st)] = weakref.ref(st)
        for _, s in self._held:
            if s.device is None and s.original() is st:
                s.device = st

    def _is_unversioned(self, st: torch.UntypedStorage | None) -> bool:
        if not self._unversioned or st is None:
            return False
        ref = self._unversioned.get(id(st))
        return ref is not None and ref() is st

    def _let_go(self, s: MoveSlot, slot: int) -> None:
        """Drop the slot's hold of the user's storage. If a ``.data`` alias may have written
        it since the copy out (no version counter tells), its final bytes go out again first,
        into the same host bytes (the device bytes are freed once that copy has read them);
        one the fallback's dispatch mode evicted has its final bytes with the mode, and stays
        (it costs no device bytes)."""
        device = s.device
        if device is not None and device is s.original():
            if device.nbytes() != s.nbytes:
                return
            if self._is_unversioned(device):
                self._copy_out(s, slot, again=True)
        s.device = None

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
                if s.device is None and (s.host is not None or self._has_copy(s)):
                    self._page_in(s, slot)
            elif s.device is not None and (s.host is not None or self._has_copy(s)):  # a release: only
                # with a host copy (``_has_copy``: on disk, through the tier)
                s.view = None
                out = True
                if self.tier is not None:
                    self.tier.evicted(s)
                if s.device is s.original() and s.held_elsewhere():
                    # Python still holds it: its bytes stay (unpack reads them) until it lets go
                    self._held.append((slot, s))
                    self._held_bytes += s.nbytes
                    if self._is_unversioned(s.device):
                        continue  # kept by the slot: a ``.data`` alias may still write it
                if self._unversioned:
                    self._let_go(s, slot)
                else:
                    s.device = None
        if out:  # finished copies out let go of their sources (released storages) here
            self.engine.poll()

    def _host(self, nbytes: int) -> tuple[Tensor, Any] | None:
        """Host bytes for a copy out, and the copy they must wait for."""
        if self.tier is not None:
            return self.tier.acquire(nbytes)
        if self._slab is None and not self._own:
            got = self.pool.acquire_with_event(max(self.schedule.host_bytes, 1))
            if got is not None:
                self._slab, self._slab_after = got
                self._slab_bytes = got[0].numel()
        slab, cut = self._slab, self._cut
        if slab is not None and cut + nbytes <= self._slab_bytes:
            self._cut = cut + aligned(nbytes)
            after = self._slab_after
            if after is not None and self.engine.is_done(after):
                after = self._slab_after = None
            return slab[cut:cut + nbytes], after
        got = self.pool.acquire_with_event(nbytes)
        if got is None:
            return None
        self._own.append(got[0])
        return got[0][:nbytes], got[1]

    def _copy_out(self, s: MoveSlot, slot: int, again: bool = False) -> None:
        """The storage's bytes to host (``again``: its final bytes, over its host copy, after
        the first copy out into them)."""
        storage = s.device
        if again and self.tier is not None:
            self.tier.bring_to_host(s)  # the copy's bytes are overwritten in its slab, not on disk
        if storage is None or (s.host is not None) != again:
            return
        if again:
            after = s.d2h if s.d2h is not None and not self.engine.is_done(s.d2h) else None
        else:
            got = self._host(s.nbytes)
            if got is None:  # the host's cap or budget: the storage stays on the device, past the
                if self.on_held is not None:  # plan's bytes: the dispatch mode keeps the budget
                    self._settle()
                    self.on_held(f"no host room for storage {s.sid}'s copy ({s.nbytes} bytes)")
                return
            s.host, after = got
        src = byte_view(storage)
        s.src = weakref.ref(src)
        host = s.host if self.tier is None else s.host[:s.nbytes]  # the tier's slabs are whole
        s.d2h = self.engine.copy_d2h(host, src, after, slot)
        if self._shared is not None and s.d2h is not None:
            self._shared(s.d2h)  # the user may write the storage meanwhile (a torn copy is never used)
        self.bytes_d2h += s.nbytes

    def _page_in(self, s: MoveSlot, slot: int = -1) -> torch.UntypedStorage:
        tier = self.tier
        if tier is not None:
            tier.bring_to_host(s)
        assert s.host is not None
        dst = torch.empty(s.nbytes, dtype=torch.uint8, device=self.device)
        after = s.d2h if s.d2h is not None and not self.engine.is_done(s.d2h) else None
        s.h2d = self.engine.copy_h2d(dst, s.host if tier is None else s.host[:s.nbytes], after, -1)
        s.device = storage = dst.untyped_storage()
        self._paged[id(storage)] = (slot, weakref.ref(storage))
        self.bytes_h2d += s.nbytes
        if tier is not None:
            tier.returned(s, self._drop_host_copy)
        return storage

    def _has_copy(self, s: MoveSlot) -> bool:
        """Whether the slot's bytes are on host, or on disk through the tier."""
        return s.host is not None or (self.tier is not None and self.tier.holds(s))

    def _drop_host_copy(self, s: MoveSlot) -> None:
        """The tier needs the room of a slot back on the device: its host copy goes (kept where
        the slot let go of its device bytes since: then it is the only copy)."""
        assert self.tier is not None
        if s.device is None:
            return
        self.tier.forget(s)
        if s.host is not None:
            self.pool.release(s.host, s.h2d)
            s.host = None
        if s.h2d is not None:  # a later copy out of these bytes must read them landed (its
            self.engine.wait(s.h2d)  # own slab's event need not be this copy's), as the
            s.h2d = None  # manager's release_host settles its copies in

    def paged_slot(self, storage: torch.UntypedStorage) -> int | None:
        """The slot whose paged-in copy ``storage`` is, or None."""
        known = self._paged.get(id(storage))
        return known[0] if known is not None and known[1]() is storage and known[0] >= 0 else None

    def _forward_ended(self) -> None:
        """What forward released that Python still holds (at the first unpack, or the step's
        end): kept on the device through backward, past the plan."""
        held = self._alive_held()
        self.held_past_release = self._held_bytes
        self.held_sids = frozenset(self.schedule.slot_sid[slot] for slot, _ in held)

    def finish(self) -> None:
        """At the step's end: a slot whose handles outlive the step (a graph kept for later)
        gets its bytes back on the device; the host slabs go back to the pool."""
        if self.on_plan and self.event <= self.schedule.forward_end:
            self._forward_ended()  # no backward ran in the step
        slots = list(self.slots.values())
        self.slots.clear()
        self._held.clear()
        self._paged.clear()
        tier, slabs = self.tier, []
        while slots:
            s = slots.pop()
            if s.device is None and self._has_copy(s) and sys.getrefcount(s) > _UNHELD:
                self._page_in(s)  # a handle still holds it
            if tier is not None:
                tier.forget(s)
                if s.host is not None:
                    slabs.append(s.host)
            s.host = None
        self.engine.synchronize()
        for slab in slabs:
            self.pool.release(slab, None)
        if self._slab is not None:
            self.pool.release(self._slab, None)
            self._slab = None
        for slab in self._own:
            self.pool.release(slab, None)
        self._own.clear()


_UNHELD = 2  # ``sys.getrefcount`` of a slot only ``finish``'s local name holds (and the call's argument)
