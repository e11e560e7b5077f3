"""Where each tracked activation storage lives: on the device, on host, or both.

We change residency on the storage itself instead of wrapping outputs (the design's
``ShadowTensor``): evicting copies the storage's bytes to a host slab and resizes it to
0 bytes; paging in resizes it back and copies the bytes in. No wrapper means gradients,
outputs and autograd's saved tensors stay plain tensors after the step, no per-op rewrap
cost, and views, identity and version counters are untouched (copies go through a fresh
uint8 alias). The price: a 0-byte storage must never reach a kernel, so capture pages
every evicted input in before its op. Only weak references to device storages are held
(a strong one would keep the memory alive); a storage's death arrives by weakref callback.

Copies are asynchronous when the engine is. Each entry keeps the event of its in-flight
D2H and H2D; an op waits only on the events of storages it reads or writes. A release
whose D2H is still reading the device bytes, where the engine cannot guard the memory
itself (the CPU thread engine), leaves the ``resize_(0)`` until the copy is done
(``reap``); paging such a storage back in before then just cancels the free. Until then
its bytes still occupy the device: they count in ``pending_bytes``, which every measure of
resident bytes adds, and ``free_pending_until`` waits for the oldest such copies when the
budget needs their room. So what a step holds never depends on when a copy happens to end.
"""

from __future__ import annotations

import functools
import logging
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from hyperpar.offload.runtime.checksum import checksum
from hyperpar.offload.runtime.copy_engine import CopyEngine
from hyperpar.offload.runtime.disk_tier import DiskTier
from hyperpar.offload.runtime.host_pool import HostPool
from hyperpar.offload.runtime.normal_tensors import made_outside_inference_mode

logger = logging.getLogger(__name__)


class HostCopyCorruptedError(RuntimeError):
    """``verify=True``: bytes that came back differ from the bytes that left."""


class RestoreError(RuntimeError):
    """The end of a step could not bring some storages' bytes back; names every one."""

    def __init__(self, lost: list[tuple[StorageEntry, BaseException]]) -> None:
        self.lost = lost
        parts = [f"storage {e.sid} ({e.nbytes} bytes, made by op {e.producer_op}): {exc!r}"
                 if e.sid >= 0 else f"waiting for copies: {exc!r}" for e, exc in lost]
        super().__init__(f"{len(lost)} storage(s) could not be restored after the step; their "
                         f"tensors hold undefined values: " + "; ".join(parts))
        self.__cause__ = lost[0][1]


@made_outside_inference_mode
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
    h2d_event: Any = None  # in-flight copy into the device storage
    d2h_event: Any = None  # in-flight copy out of the device storage
    host_event: Any = None  # the last copy that used the host slab
    free_pending: bool = False  # released, but the device bytes wait for their D2H to finish
    checksum: tuple[int, int] | None = None  # verify mode: of the bytes the D2H copied


class ResidencyManager:
    """The sid -> entry table, and the four actions of a schedule on it."""

    def __init__(self, device: torch.device, pool: HostPool, engine: CopyEngine,
                 verify: bool = False) -> None:
        self.device = device
        self.pool = pool
        self.engine = engine
        self.verify = verify
        self.tier: DiskTier | None = None  # host budget: copies beyond it spill to disk (``use_disk``)
        self.entries: dict[int, StorageEntry] = {}
        self.by_key: dict[int, StorageEntry] = {}
        self.evicted: dict[int, StorageEntry] = {}  # key -> alive, non-resident entry
        self.inflight: dict[int, StorageEntry] = {}  # key -> resident entry whose H2D is not waited on
        self.pending_free: list[StorageEntry] = []  # in release order
        self.pending_bytes = 0  # bytes of released storages whose device memory is not freed yet
        self.resident_bytes = 0  # bound, alive, resident bytes
        self.away_bytes = 0  # bound, alive, not resident (released, or its free pending)
        self.offloaded_bytes = 0  # released within their lifetime (not after the last access)
        self.bytes_d2h = 0
        self.bytes_h2d = 0
        self.demand_faults = 0
        self.cap_hits = 0
        self.describe_op: Callable[[], str] = lambda: "outside an op"

    @property
    def engine(self) -> CopyEngine:
        return self._engine

    @engine.setter
    def engine(self, engine: CopyEngine) -> None:
        """Swappable between steps (tests inject failing or slow engines this way)."""
        self._engine = engine
        self._async = bool(getattr(engine, "asynchronous", False))

    def use_disk(self, directory: str, host_budget_bytes: int) -> None:
        """Keep the host slabs of activations within ``host_budget_bytes``, the rest in ``directory``."""
        self.tier = DiskTier(directory, host_budget_bytes, self.pool, self._finish,
                             lambda event: self.engine.is_done(event), self.release_host)

    @property
    def bytes_to_disk(self) -> int:
        return 0 if self.tier is None else self.tier.bytes_to_disk

    @property
    def bytes_from_disk(self) -> int:
        return 0 if self.tier is None else self.tier.bytes_from_disk

    def disk_ms(self) -> tuple[float, float]:
        """Milliseconds the disk tier's I/O thread spent writing and reading this step."""
        tier = self.tier
        return (0.0, 0.0) if tier is None else (tier.write_s * 1e3, tier.read_s * 1e3)

    @property
    def peak_host_bytes(self) -> int:
        """Host bytes held at the step's peak for activations: the pool's arenas (pinned or
        not, carved or cached) and the disk tier's staging buffer."""
        return self.pool.step_peak_held_bytes + (0 if self.tier is None else self.tier.held_bytes)

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

    def pin(self, storages: list[torch.UntypedStorage]) -> None:
        """Keep these storages on the device for the rest of the step (pages them in first)."""
        for st in storages:
            entry = self.lookup(st)
            if entry is not None:
                if not entry.resident or entry.free_pending:
                    self.copy_h2d(entry, demand=True)
                entry.evictable = False

    def _on_death(self, sid: int, ref: weakref.ref) -> None:
        # Keyed by sid (not the entry) so that entry -> ref -> callback makes no cycle.
        entry = self.entries.get(sid)
        if entry is not None and entry.ref is ref:
            self._forget(entry)

    def _forget(self, entry: StorageEntry) -> None:
        self.entries.pop(entry.sid, None)
        if self.by_key.get(entry.key) is entry:
            del self.by_key[entry.key]
        if self.inflight.get(entry.key) is entry:
            del self.inflight[entry.key]
        if entry.resident:
            self.resident_bytes -= entry.nbytes
        else:
            self.away_bytes -= entry.nbytes
            if self.evicted.get(entry.key) is entry:
                del self.evicted[entry.key]
        if entry.offloaded:
            entry.offloaded = False
            self.offloaded_bytes -= entry.nbytes
        if entry.free_pending:
            entry.free_pending = False
            self.pending_bytes -= entry.nbytes
        self._drop_host(entry)

    # --- actions --------------------------------------------------------------------
    def copy_d2h(self, entry: StorageEntry) -> bool:
        """Start making the host copy current. False when the pool is at its cap."""
        if entry.host_current or not entry.resident:
            return entry.host_current
        storage = entry.ref()
        if storage is None:
            return False
        nbytes = storage.nbytes()
        after = entry.host_event
        if entry.host is None or entry.host.numel() < nbytes:
            self._drop_host(entry)
            got = self.pool.acquire_with_event(nbytes) if self.tier is None else self.tier.acquire(nbytes)
            if got is None:
                self.cap_hits += 1
                return False
            entry.host, after = got
        if self._async:
            self.engine.poll()  # drop finished copies' tensors here, on the compute thread
        src = byte_view(storage)
        if self.verify:
            self._settle_h2d(entry)
            entry.checksum = checksum(src)
        dst = entry.host[:nbytes]
        if self._async:
            self._settle_h2d(entry)  # copying out bytes still arriving: rare, wait for them
            event = self.engine.copy_d2h(dst, src, after, entry.sid)
        else:
            event = self.engine.copy_d2h(dst, src)
            self.engine.wait(event)
            event = None
        entry.d2h_event = entry.host_event = event
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
        if entry.h2d_event is not None:
            self._settle_h2d(entry)  # never free memory a copy is still writing
        d2h = entry.d2h_event
        if d2h is not None and not self.engine.may_free_now(storage, d2h):
            if not storage.resizable():
                entry.evictable = False
                return False
            entry.free_pending = True
            self.pending_free.append(entry)
            self.pending_bytes += entry.nbytes
        else:
            try:
                storage.resize_(0)
            except RuntimeError:  # not resizable (external memory): stays on the device
                entry.evictable = False
                return False
        entry.resident = False
        self.resident_bytes -= entry.nbytes
        self.away_bytes += entry.nbytes
        self.evicted[entry.key] = entry
        if not final:
            entry.offloaded = True
            self.offloaded_bytes += entry.nbytes
        if self.tier is not None:
            self.tier.evicted(entry)
        return True

    def copy_h2d(self, entry: StorageEntry, demand: bool = False) -> None:
        """Start bringing the bytes back (waited on at once when ``demand``); a release always
        leaves a current host copy behind."""
        if entry.resident:
            if demand:
                self.wait_h2d(entry)
            return
        storage = entry.ref()
        if storage is None:
            return
        tier = self.tier
        if entry.free_pending:  # the device bytes never left: cancel the free
            entry.free_pending = False
            self.pending_bytes -= entry.nbytes
            if tier is not None:  # a copy on the device again is no more the tier's to spill
                tier.bring_to_host(entry)
                tier.returned(entry)
            self._now_resident(entry)
            if demand:
                self.demand_faults += 1
            return
        if tier is not None:
            tier.bring_to_host(entry)
        assert entry.host is not None, f"storage {entry.sid} was released without a host copy"
        storage.resize_(entry.nbytes)
        dst, src = byte_view(storage), entry.host[: entry.nbytes]
        if self._async:
            after = entry.d2h_event if not self.engine.is_done(entry.d2h_event) else None
            event = self.engine.copy_h2d(dst, src, after, entry.sid)
            entry.h2d_event = entry.host_event = event
            self.inflight[entry.key] = entry
        else:
            self.engine.wait(self.engine.copy_h2d(dst, src))
            entry.host_event = None
        self._now_resident(entry)
        self.bytes_h2d += entry.nbytes
        if tier is not None:
            tier.returned(entry)
        if demand:
            self.demand_faults += 1
            self.wait_h2d(entry)
        elif not self._async and self.verify:
            self._check(entry, storage)

    def _now_resident(self, entry: StorageEntry) -> None:
        entry.resident = True
        del self.evicted[entry.key]
        self.resident_bytes += entry.nbytes
        self.away_bytes -= entry.nbytes
        if entry.offloaded:
            entry.offloaded = False
            self.offloaded_bytes -= entry.nbytes

    def wait_h2d(self, entry: StorageEntry) -> None:
        """The compute side waits for the storage's bytes to have arrived (verify: checks them)."""
        event = entry.h2d_event
        if event is not None:
            self.engine.wait(event)
            entry.h2d_event = None
            if self.inflight.get(entry.key) is entry:
                del self.inflight[entry.key]
        if self.verify and entry.checksum is not None and entry.host_current:
            storage = entry.ref()
            if storage is not None:
                self._check(entry, storage)

    def wait_d2h(self, entry: StorageEntry) -> None:
        """Before an op writes the storage: its copy out must have read the old bytes."""
        event = entry.d2h_event
        if event is not None:
            self.engine.wait(event)
            entry.d2h_event = None

    def pending_d2h_writes_possible(self) -> bool:
        """Whether any copy out may still be reading a storage (cheap check for safe mode)."""
        return self._async and bool(self.entries)

    def wait_d2h_of(self, storages: list[torch.UntypedStorage]) -> None:
        for st in storages:
            entry = self.lookup(st)
            if entry is not None and entry.d2h_event is not None:
                self.wait_d2h(entry)

    def _settle_h2d(self, entry: StorageEntry) -> None:
        if entry.h2d_event is not None:
            self.wait_h2d(entry)

    def _check(self, entry: StorageEntry, storage: torch.UntypedStorage) -> None:
        expected = entry.checksum
        if expected is None:
            return
        got = checksum(byte_view(storage))  # kept: a later page-in of the same copy is checked too
        if got != expected:
            raise HostCopyCorruptedError(
                f"verify: storage {entry.sid} ({entry.nbytes} bytes, produced by op {entry.producer_op}) "
                f"came back from host with other bytes than it left with, {self.describe_op()} "
                f"(checksum {got} != {expected})"
            )

    def release_host(self, entry: StorageEntry) -> None:
        if entry.resident:
            self._settle_h2d(entry)
            self._drop_host(entry)
        # A released storage keeps its only copy; it goes back to the pool when the storage
        # dies (usually right after its last access) or at the end of the step.

    def mark_written(self, entry: StorageEntry) -> None:
        entry.host_current = False
        entry.checksum = None

    def page_in_inputs(self, tensors: list[torch.Tensor]) -> list[StorageEntry]:
        """Every evicted storage among ``tensors`` comes back now; in-flight ones are waited on.
        Returns the entries that came back."""
        evicted, inflight = self.evicted, self.inflight
        back: list[StorageEntry] = []
        for t in tensors:
            try:
                storage = t.untyped_storage()
            except (RuntimeError, NotImplementedError):
                continue
            key = storage._cdata
            entry = evicted.get(key)
            if entry is not None and entry.ref() is storage:
                self.copy_h2d(entry, demand=True)
                back.append(entry)
                continue
            entry = inflight.get(key)
            if entry is not None and entry.ref() is storage:
                self.wait_h2d(entry)
        return back

    def reap(self) -> None:
        """Free the device bytes of releases whose D2H has finished (compute thread only)."""
        if self._async:
            self.engine.poll()
        pending = self.pending_free
        if not pending:
            return
        keep = []
        for entry in pending:
            if not entry.free_pending:
                continue
            if not self.engine.is_done(entry.d2h_event):
                keep.append(entry)
                continue
            entry.free_pending = False
            self.pending_bytes -= entry.nbytes
            entry.d2h_event = None
            storage = entry.ref()
            if storage is not None:
                storage.resize_(0)
        self.pending_free = keep

    def finish_copies_of(self, storages: list[torch.UntypedStorage]) -> None:
        """Let every copy still using one of ``storages`` finish, and let go of it: a storage
        whose Python references are gone lives on while a copy holds it (the CPU engines), so
        whether it is alive at a given moment would otherwise depend on copy timing."""
        if not self._async:
            return
        for st in storages:
            entry = self.lookup(st)
            if entry is not None:
                for event in (entry.d2h_event, entry.h2d_event):
                    if event is not None and not self.engine.is_done(event):
                        self._finish(event)
        self.engine.poll()

    def free_pending_until(self, excess: int) -> None:
        """Wait for the copies of the oldest releases still holding device memory until
        ``excess`` bytes of it are free (or none is left): room the budget needs now, whenever
        those copies would have ended on their own."""
        self.reap()
        for entry in list(self.pending_free):
            if excess <= 0:
                break
            if entry.free_pending:
                self._finish(entry.d2h_event)
                excess -= entry.nbytes
        self.reap()

    def _finish(self, event: Any) -> None:
        """The host waits for the copy (an engine object without ``finish``: its ``wait``)."""
        finish = getattr(self.engine, "finish", None)
        (finish or self.engine.wait)(event)

    # --- end of step ----------------------------------------------------------------
    def restore_all(self) -> None:
        """Page in every evicted storage still alive (the user may keep any of them).

        A copy that fails is retried as a plain synchronous copy from the host slab, so a
        broken copy engine loses nothing. Only a storage whose bytes cannot come back
        (corrupted, or the retry fails too) is lost; it is still allocated again, so no tensor
        is left over a 0-byte storage. Every storage is tried before one error names all the
        lost ones.
        """
        lost: list[tuple[StorageEntry, BaseException]] = []
        try:
            if self._async:  # finished copies let go of their storages: the dead ones are forgotten
                self.engine.synchronize()
                self.engine.poll()
        except BaseException as exc:  # a failed copy surfaces here on some engines
            logger.warning("copy engine failed while settling before restore: %s", exc)
        for entry in list(self.evicted.values()):
            storage = entry.ref()
            if storage is None:
                continue
            try:
                self.copy_h2d(entry)
            except BaseException as exc:  # finish the others first
                if not self._copy_back_directly(entry, storage, exc):
                    lost.append((entry, exc))
        for entry in list(self.inflight.values()):
            try:
                self.wait_h2d(entry)
            except BaseException as exc:
                self.inflight.pop(entry.key, None)
                entry.h2d_event = None
                storage = entry.ref()
                if storage is not None and not self._copy_back_directly(entry, storage, exc):
                    lost.append((entry, exc))
        try:
            self.wait_all()
        except BaseException as exc:
            lost.append((StorageEntry(-1, 0, None, 0), exc))  # type: ignore[arg-type]
        if lost:
            raise RestoreError(lost)

    def _copy_back_directly(self, entry: StorageEntry, storage: torch.UntypedStorage,
                            cause: BaseException) -> bool:
        """Bring the bytes back without the engine; False when they are lost."""
        try:
            if entry.free_pending:
                ok = True  # the device bytes never left
            elif isinstance(cause, HostCopyCorruptedError) or not self._host_copy(entry):
                ok = False
            else:
                if entry.host_event is not None:
                    self.engine.wait(entry.host_event)
                if storage.nbytes() != entry.nbytes:
                    storage.resize_(entry.nbytes)
                byte_view(storage).copy_(entry.host[: entry.nbytes])
                ok = True
        except BaseException as exc:
            logger.warning("storage %d could not be copied back from host: %s", entry.sid, exc)
            ok = False
        self._force_resident(entry, storage)
        return ok

    def _force_resident(self, entry: StorageEntry, storage: torch.UntypedStorage) -> None:
        if self.tier is not None:
            self.tier.forget(entry)  # its bytes are on the device or lost: nothing of it to spill
        try:
            if storage.nbytes() != entry.nbytes and not entry.free_pending:
                storage.resize_(entry.nbytes)  # never leave a 0-byte storage behind
        except RuntimeError as exc:
            logger.warning("storage %d could not be allocated again: %s", entry.sid, exc)
        if entry.free_pending:
            entry.free_pending = False
            self.pending_bytes -= entry.nbytes
        if self.inflight.get(entry.key) is entry:
            del self.inflight[entry.key]
        entry.h2d_event = None
        if not entry.resident:
            entry.resident = True
            self.resident_bytes += entry.nbytes
            self.away_bytes -= entry.nbytes
            if entry.offloaded:
                entry.offloaded = False
                self.offloaded_bytes -= entry.nbytes
        self.evicted.pop(entry.key, None)

    def wait_all(self) -> None:
        """Every in-flight copy done and waited on (each H2D checked in verify mode)."""
        errors: list[BaseException] = []
        for entry in list(self.inflight.values()):
            try:
                self.wait_h2d(entry)
            except BaseException as exc:
                errors.append(exc)
                self.inflight.pop(entry.key, None)
                entry.h2d_event = None
        if self._async:
            self.engine.synchronize()
            self.reap()
        if errors:
            raise errors[0]

    def clear(self) -> None:
        """Forget every entry and return every host slab to the pool."""
        if self._async:
            self.engine.synchronize()
            self.engine.poll()
        for entry in list(self.entries.values()):
            self._drop_host(entry)
        self.entries.clear()
        self.by_key.clear()
        self.evicted.clear()
        self.inflight.clear()
        self.pending_free = []
        self.pending_bytes = 0
        self.resident_bytes = 0
        self.away_bytes = 0
        self.offloaded_bytes = 0

    def _host_copy(self, entry: StorageEntry) -> bool:
        """Whether the entry's bytes are in its host slab (read back from disk if they were there)."""
        if self.tier is not None:
            try:
                self.tier.bring_to_host(entry)
            except BaseException as exc:
                logger.warning("storage %d could not be read back from disk: %s", entry.sid, exc)
                return False
        return entry.host is not None

    def _drop_host(self, entry: StorageEntry) -> None:
        if self.tier is not None:
            self.tier.forget(entry)
        if entry.host is not None:
            self.pool.release(entry.host, entry.host_event)
            entry.host = None
        entry.host_current = False
        entry.host_event = None
        entry.checksum = None
