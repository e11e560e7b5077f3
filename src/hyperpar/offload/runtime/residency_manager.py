"""Where each tracked activation storage lives: on the device, on host, or both.

We change residency on the storage itself instead of wrapping outputs (the design's
``ShadowTensor``): evicting copies the storage's bytes to a host slab and resizes it to
0 bytes; paging in resizes it back and copies the bytes in. No wrapper means gradients,
outputs and autograd's saved tensors stay plain tensors after the step, no per-op rewrap
cost, and views, identity and version counters are untouched (copies go through a fresh
uint8 alias). The price: a 0-byte storage must never reach a kernel, so capture pages
every evicted input in before its op. Only weak references to device storages are held
(a strong one would keep the memory alive); a storage's death arrives by weakref callback.
"""

from __future__ import annotations

import functools
import logging
import weakref
from dataclasses import dataclass

import torch

from hyperpar.offload.runtime.copy_engine import CopyEngine
from hyperpar.offload.runtime.host_pool import HostPool

logger = logging.getLogger(__name__)


def byte_view(storage: torch.UntypedStorage) -> torch.Tensor:
    """A fresh uint8 tensor over the whole storage (its own version counter)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


@dataclass(slots=True, eq=False)
class StorageEntry:
    sid: int
    key: int  # storage._cdata, valid while ref() is alive
    ref: weakref.ref
    nbytes: int
    producer_op: int = -1
    resident: bool = True
    host: torch.Tensor | None = None  # slab (aligned size) when a host copy exists
    host_current: bool = False
    evictable: bool = True
    offloaded: bool = False  # counted in ResidencyManager.offloaded_bytes
    h2d_event: torch.Event | None = None


class ResidencyManager:
    """The sid -> entry table, and the four actions of a schedule on it."""

    def __init__(self, device: torch.device, pool: HostPool, engine: CopyEngine) -> None:
        self.device = device
        self.pool = pool
        self.engine = engine
        self.entries: dict[int, StorageEntry] = {}
        self.by_key: dict[int, StorageEntry] = {}
        self.evicted: dict[int, StorageEntry] = {}  # key -> alive, non-resident entry
        self.resident_bytes = 0  # bound, alive, resident bytes
        self.offloaded_bytes = 0  # released within their lifetime (not after the last access)
        self.bytes_d2h = 0
        self.bytes_h2d = 0
        self.demand_faults = 0
        self.cap_hits = 0

    # --- identity -------------------------------------------------------------------
    def bind(self, sid: int, storage: torch.UntypedStorage, producer_op: int = -1) -> StorageEntry:
        old = self.entries.get(sid)
        if old is not None:
            if old.ref() is storage:
                return old
            self._forget(old)
        entry = StorageEntry(sid=sid, key=storage._cdata, ref=None, nbytes=storage.nbytes(),  # type: ignore[arg-type]
                             producer_op=producer_op)
        entry.ref = weakref.ref(storage, functools.partial(self._on_death, sid))
        self.entries[sid] = entry
        self.by_key[entry.key] = entry
        self.resident_bytes += entry.nbytes
        return entry

    def lookup(self, storage: torch.UntypedStorage) -> StorageEntry | None:
        entry = self.by_key.get(storage._cdata)
        if entry is not None and entry.ref() is storage:
            return entry
        return None

    def _on_death(self, sid: int, ref: weakref.ref) -> None:
        # Keyed by sid (not the entry) so that entry -> ref -> callback makes no cycle.
        entry = self.entries.get(sid)
        if entry is not None and entry.ref is ref:
            self._forget(entry)

    def _forget(self, entry: StorageEntry) -> None:
        self.entries.pop(entry.sid, None)
        if self.by_key.get(entry.key) is entry:
            del self.by_key[entry.key]
        if entry.resident:
            self.resident_bytes -= entry.nbytes
        elif self.evicted.get(entry.key) is entry:
            del self.evicted[entry.key]
        if entry.offloaded:
            entry.offloaded = False
            self.offloaded_bytes -= entry.nbytes
        self._drop_host(entry)

    # --- actions --------------------------------------------------------------------
    def copy_d2h(self, entry: StorageEntry) -> bool:
        """Make the host copy current. False when the pool is at its cap."""
        if entry.host_current or not entry.resident:
            return entry.host_current
        storage = entry.ref()
        if storage is None:
            return False
        nbytes = storage.nbytes()
        if entry.host is None or entry.host.numel() < nbytes:
            self._drop_host(entry)
            entry.host = self.pool.acquire(nbytes)
            if entry.host is None:
                self.cap_hits += 1
                return False
        self.engine.wait(self.engine.copy_d2h(entry.host[:nbytes], byte_view(storage)))
        entry.nbytes = nbytes
        entry.host_current = True
        self.bytes_d2h += nbytes
        return True

    def release_device(self, entry: StorageEntry, final: bool = False) -> bool:
        """Drop the device bytes; only with a current host copy, even after the planned last
        access (``final``): a tensor the user unexpectedly kept must still be whole."""
        if not entry.resident or not entry.evictable or not entry.host_current:
            return False
        storage = entry.ref()
        if storage is None:
            return False
        try:
            storage.resize_(0)
        except RuntimeError:  # not resizable (external memory): stays on the device
            entry.evictable = False
            return False
        entry.resident = False
        self.resident_bytes -= entry.nbytes
        self.evicted[entry.key] = entry
        if not final:
            entry.offloaded = True
            self.offloaded_bytes += entry.nbytes
        return True

    def copy_h2d(self, entry: StorageEntry, demand: bool = False) -> None:
        """Bring the bytes back (a release always leaves a current host copy behind)."""
        if entry.resident:
            return
        storage = entry.ref()
        if storage is None:
            return
        assert entry.host is not None, f"storage {entry.sid} was released without a host copy"
        storage.resize_(entry.nbytes)
        entry.h2d_event = self.engine.copy_h2d(byte_view(storage), entry.host[: entry.nbytes])
        self.engine.wait(entry.h2d_event)
        entry.h2d_event = None
        entry.resident = True
        del self.evicted[entry.key]
        self.resident_bytes += entry.nbytes
        if entry.offloaded:
            entry.offloaded = False
            self.offloaded_bytes -= entry.nbytes
        self.bytes_h2d += entry.nbytes
        if demand:
            self.demand_faults += 1

    def release_host(self, entry: StorageEntry) -> None:
        if entry.resident:
            self._drop_host(entry)
        # A released storage keeps its only copy; it goes back to the pool when the storage
        # dies (usually right after its last access) or at the end of the step.

    def mark_written(self, entry: StorageEntry) -> None:
        entry.host_current = False

    def page_in_inputs(self, tensors: list[torch.Tensor]) -> None:
        """Demand paging: every evicted storage among ``tensors`` comes back now."""
        evicted = self.evicted
        for t in tensors:
            try:
                storage = t.untyped_storage()
            except (RuntimeError, NotImplementedError):
                continue
            entry = evicted.get(storage._cdata)
            if entry is not None and entry.ref() is storage:
                self.copy_h2d(entry, demand=True)

    # --- end of step ----------------------------------------------------------------
    def restore_all(self) -> None:
        """Page in every evicted storage still alive (the user may keep any of them)."""
        for entry in list(self.evicted.values()):
            if entry.ref() is not None:
                self.copy_h2d(entry)

    def clear(self) -> None:
        """Forget every entry and return every host slab to the pool."""
        for entry in list(self.entries.values()):
            self._drop_host(entry)
        self.entries.clear()
        self.by_key.clear()
        self.evicted.clear()
        self.resident_bytes = 0
        self.offloaded_bytes = 0

    def _drop_host(self, entry: StorageEntry) -> None:
        if entry.host is not None:
            self.pool.release(entry.host)
            entry.host = None
        entry.host_current = False
