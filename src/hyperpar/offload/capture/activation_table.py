"""Every activation storage of the running step, by storage id (sid), cheaply.

Warmup and replay both bind each storage an op creates to a sid here: a weak reference
(the table must not keep memory alive), its size and the op that made it. That is what
lets replay check that an op reads and writes the very storages the plan expects, and
lets any step measure its resident activation bytes the same way. Storages the schedule
moves additionally get a ``StorageEntry`` in the residency manager; the rest cost a few
list slots.

A storage is looked up by ``id()`` of its Python object (torch keeps one object per live
storage); a stale id, left by a dead storage whose address was reused, never matches
because the weak reference must still point at the very object.
"""

from __future__ import annotations

import weakref

import torch


class ActivationTable:
    __slots__ = ("_ref_sid", "death", "live_bytes", "nbytes", "now", "pinned", "producer", "refs", "sid_of")

    def __init__(self) -> None:
        self.refs: list[weakref.ref | None] = []
        self.nbytes: list[int] = []
        self.producer: list[int] = []
        self.sid_of: dict[int, int] = {}  # id(storage) -> sid; checked against refs
        self._ref_sid: dict[int, int] = {}  # id(weak ref) -> sid, for the death callback
        self.live_bytes = 0  # bytes of bound storages still alive (on the device or not)
        self.pinned: set[int] = set()  # sids that must never leave the device this step
        self.now = 0  # the op running now (the executor keeps it current)
        self.death: dict[int, int] = {}  # sid -> the op during which its storage died

    def reserve(self, num_sids: int) -> None:
        """Room for sids ``0 .. num_sids-1`` (replay knows them from the plan)."""
        missing = num_sids - len(self.refs)
        if missing > 0:
            self.refs.extend([None] * missing)
            self.nbytes.extend([0] * missing)
            self.producer.extend([-1] * missing)

    @property
    def num_sids(self) -> int:
        return len(self.refs)

    def new_sid(self) -> int:
        self.reserve(len(self.refs) + 1)
        return len(self.refs) - 1

    def bind(self, sid: int, storage: torch.UntypedStorage, producer: int) -> None:
        ref = weakref.ref(storage, self._dead)
        self._ref_sid[id(ref)] = sid
        old = self.refs[sid]
        if old is not None and self._ref_sid.pop(id(old), None) is not None:
            self.live_bytes -= self.nbytes[sid]  # rebound while the old one lives
        self.refs[sid] = ref
        self.sid_of[id(storage)] = sid
        nbytes = storage.nbytes()
        self.nbytes[sid] = nbytes
        self.producer[sid] = producer
        self.live_bytes += nbytes

    def lookup(self, storage: torch.UntypedStorage) -> int | None:
        sid = self.sid_of.get(id(storage))
        if sid is not None:
            ref = self.refs[sid]
            if ref is not None and ref() is storage:
                return sid
        return None

    def storage(self, sid: int) -> torch.UntypedStorage | None:
        ref = self.refs[sid] if sid < len(self.refs) else None
        return None if ref is None else ref()

    def resize(self, sid: int, nbytes: int) -> None:
        """An op with ``out=`` (or ``resize_``) changed a bound storage's size."""
        if self.refs[sid] is not None and id(self.refs[sid]) in self._ref_sid:
            self.live_bytes += nbytes - self.nbytes[sid]
        self.nbytes[sid] = nbytes

    def alive(self) -> list[int]:
        """Sids whose storage is still alive."""
        return [sid for sid, ref in enumerate(self.refs) if ref is not None and ref() is not None]

    def _dead(self, ref: weakref.ref) -> None:
        sid = self._ref_sid.pop(id(ref), None)
        if sid is not None:
            self.live_bytes -= self.nbytes[sid]
            self.death[sid] = self.now
