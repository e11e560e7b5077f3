"""Every activation storage of the running step, by storage id (sid), cheaply.

Warmup and replay both bind each storage an op creates to a sid here: a weak reference
(the table must not keep memory alive), its size and the op that made it. That is what
lets replay check that an op reads and writes the very storages the plan expects, and
lets any step measure its resident activation bytes the same way. Storages the schedule
moves additionally get a ``StorageEntry`` in the residency manager; the rest cost a few
list slots.

A storage is looked up by ``id()`` of its Python object (torch keeps one object per live
storage). ``sid_of`` holds the ids of bound storages that are alive: the death callback and a
rebinding take theirs out, so an id found there is that very storage (two live objects never
share an id), which lets replay check an op's inputs with one lookup each.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch


class _StorageRef(weakref.ref):
    """A weak reference that knows its sid (-1 once the sid is bound to another storage)."""

    __slots__ = ("sid",)


class ActivationTable:
    __slots__ = ("_clock", "_dead_cb", "death", "ids", "live_bytes", "nbytes", "pinned",
                 "producer", "refs", "sid_of")

    def __init__(self, clock: Any = None) -> None:
        """``clock``: an object whose ``index`` is one past the op running now (the executor)."""
        self._clock = None if clock is None else weakref.ref(clock)
        self.refs: list[_StorageRef | None] = []
        # id() of each sid's storage while it lives, else 0: an id seen here is that very
        # storage (the death callback clears it, and two live objects never share an id).
        self.ids: list[int] = []
        self.nbytes: list[int] = []
        self.producer: list[int] = []
        self.sid_of: dict[int, int] = {}  # id(storage) -> sid, for live bound storages only
        self.live_bytes = 0  # bytes of bound storages still alive (on the device or not)
        self.pinned: set[int] = set()  # sids that must never leave the device this step
        self.death: dict[int, int] = {}  # sid -> the op during which its storage died
        self._dead_cb = self._dead

    def reserve(self, num_sids: int) -> None:
        """Room for sids ``0 .. num_sids-1`` (replay knows them from the plan)."""
        missing = num_sids - len(self.refs)
        if missing > 0:
            self.refs.extend([None] * missing)
            self.ids.extend([0] * missing)
            self.nbytes.extend([0] * missing)
            self.producer.extend([-1] * missing)

    @property
    def num_sids(self) -> int:
        return len(self.refs)

    def new_sid(self) -> int:
        self.refs.append(None)
        self.ids.append(0)
        self.nbytes.append(0)
        self.producer.append(-1)
        return len(self.refs) - 1

    def bind_new(self, storage: torch.UntypedStorage, nbytes: int, producer: int) -> int:
        """``bind`` of a new sid (what ``new_sid`` then ``bind`` do, in one call: warmup makes
        one per new storage, on every op)."""
        ref = _StorageRef(storage, self._dead_cb)
        sid = ref.sid = len(self.refs)
        self.refs.append(ref)
        key = id(storage)
        self.ids.append(key)
        self.sid_of[key] = sid
        self.nbytes.append(nbytes)
        self.producer.append(producer)
        self.live_bytes += nbytes
        return sid

    def bind(self, sid: int, storage: torch.UntypedStorage, producer: int) -> None:
        ref = _StorageRef(storage, self._dead_cb)
        ref.sid = sid
        if self.ids[sid]:  # rebound while the old one lives: it is not ours any more
            old = self.refs[sid]
            if old is not None and old.sid >= 0:
                old.sid = -1
                self.live_bytes -= self.nbytes[sid]
            if self.sid_of.get(self.ids[sid]) == sid:
                del self.sid_of[self.ids[sid]]
        self.refs[sid] = ref
        key = id(storage)
        self.ids[sid] = key
        self.sid_of[key] = sid
        nbytes = storage.nbytes()
        self.nbytes[sid] = nbytes
        self.producer[sid] = producer
        self.live_bytes += nbytes

    def lookup(self, storage: torch.UntypedStorage) -> int | None:
        return self.sid_of.get(id(storage))

    def storage(self, sid: int) -> torch.UntypedStorage | None:
        ref = self.refs[sid] if sid < len(self.refs) else None
        return None if ref is None else ref()

    def resize(self, sid: int, nbytes: int) -> None:
        """An op with ``out=`` (or ``resize_``) changed a bound storage's size."""
        if self.ids[sid]:
            self.live_bytes += nbytes - self.nbytes[sid]
        self.nbytes[sid] = nbytes

    def alive(self) -> list[int]:
        """Sids whose storage is still alive."""
        return [sid for sid, key in enumerate(self.ids) if key]

    def _dead(self, ref: _StorageRef) -> None:
        sid = ref.sid
        if sid >= 0:
            self.live_bytes -= self.nbytes[sid]
            clock = self._clock() if self._clock is not None else None
            self.death[sid] = clock.index - 1 if clock is not None else -1
            if self.refs[sid] is ref:
                # no live object has this id any more
                self.sid_of.pop(self.ids[sid], None)
                self.ids[sid] = 0


def read_ids(reads: list[torch.UntypedStorage]) -> dict[int, weakref.ref]:
    """``id()`` of each storage a region reads, with a weak reference to it. A region's reads
    can die inside it (backward frees its incoming gradients), and a storage made there may
    then get a dead read's id: ``live_ids`` at the region's end keeps only the reads alive."""
    return {id(st): weakref.ref(st) for st in reads}


def live_ids(ids: dict[int, weakref.ref]) -> set[int]:
    """The ids of ``read_ids`` whose storage is still alive (those are still that storage's)."""
    return {key for key, ref in ids.items() if ref() is not None}
