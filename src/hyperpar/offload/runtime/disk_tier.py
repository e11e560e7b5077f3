"""The host budget: host copies beyond it go to a ``DiskStore`` and come back through host.

The residency manager asks this tier for every host slab (``acquire``) and tells it when a
storage leaves the device (``evicted``) and when its bytes must be on host again
(``bring_to_host``). The policy is online and needs no plan:

- **Spill the one needed last.** With a plan (every step after the first), the copy the plan
  brings back to the device last is written out first, and copies on disk are read back in
  the order the plan brings them back (``begin_step(copy_in)``): what Belady's rule asks, with
  the future known. Without one (the first step), by age: backward reads activations in the
  reverse order forward made them, so the copy evicted longest ago is needed last, and the
  newest on disk first (an encoder output that every decoder layer reads is where age misleads). Once the
  slabs in use pass ``SPILL_AT`` of the budget, copies are written out oldest first on the
  tier's I/O thread, ahead of need (room for the next slabs before they are asked for); a
  slab the budget needs now waits for those writes. With a plan, writes ahead of need take
  only the copies its disk plan says must go (``begin_step(must_go=...)``,
  ``planning.disk_plan``): no copy the budget could hold is written. A copy under
  ``SMALL_BYTES`` is written only when no larger one can be.
- **Read back the newest first.** Each copy back to the device (backward, mostly) frees host
  room (its host copy is dropped once that copy in is done); the tier then starts reading the
  most recently spilled extents into host while the slabs in use stay under ``READ_AT`` of
  the budget. A read ahead is never written again: when room runs short its slab is given
  back and its extent kept. A copy the device needs before its read was started is read at
  once (``demand_reads``). The two marks were chosen by measurement (the demo's GPT small,
  batch 32, host budget a quarter of the bytes moved: I/O waits per step 26 ms at 0.75 / 0.75,
  18 ms at 0.5 / 0.75, more with reads up to the whole budget).
- **Never lose a byte.** A slab goes back to the pool only once its write finished; a failed
  write (a full disk) leaves the copy on host, stops spilling for the rest of the step and
  says so once; what then does not fit the host budget stays on the device (the pool's cap),
  which the step's report shows as bytes over the device budget. Bytes read back are checked
  in ``verify`` mode like any host copy (the checksum is taken at the copy off the device).

Only the compute thread calls in; the I/O thread does nothing but ``DiskStore.write`` and
``read`` on slabs the tier holds until their future is collected. The store (its one file)
is opened at the first spill and closed, the file unlinked, by ``close_file`` (a failed
step, ``close``) or at interpreter exit.
"""

from __future__ import annotations

import logging
import os
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from hyperpar.offload.runtime.copy_engine import DISK_READ_LANE, DISK_WRITE_LANE, CopySpan
from hyperpar.offload.runtime.disk_store import DiskStore, Extent, _check_directory
from hyperpar.offload.runtime.host_pool import HostPool, aligned

logger = logging.getLogger(__name__)

_NEVER = 1 << 62  # the copy-back op of a storage the plan never copies back
SPILL_AT = 0.5  # share of the host budget in use past which copies are written out ahead of need
READ_AT = 0.75  # share of the host budget that copies read back ahead of need may fill
# copies smaller than this go to disk only when no larger one can: a direct write or read costs
# about 0.1-0.3 ms whatever its size (16 KiB moved at 0.07 GB/s on this project's disk, 8 MiB at
# 3.5), time the one I/O thread then lacks for the copies that free room
SMALL_BYTES = 256 << 10


@dataclass(slots=True, eq=False)
class _Spilled:
    """One storage's host copy on its way to disk, on disk, or on its way back."""

    nbytes: int
    sid: int  # the storage's id (the timeline's label)
    slab: torch.Tensor | None  # held while a write reads it or a read fills it
    future: Future[Any] | None = None
    extent: Extent | None = None
    writing: bool = False


class DiskTier:
    """Host slabs for the residency manager, within ``budget_bytes``, spilling to ``directory``.

    ``finish(event)`` makes the host wait for a copy (the engine's ``finish``): a slab is
    written out only once its copy off the device is done, and filled only once the copy
    that used it last is done. ``drop_copy(entry)`` drops the host copy of a storage back on
    the device (the manager's ``release_host``): the first room taken when the budget is full,
    as such a copy only saves a copy out should the storage leave again.
    """

    def __init__(self, directory: str | os.PathLike[str], budget_bytes: int, pool: HostPool,
                 finish: Callable[[Any], None], is_done: Callable[[Any], bool],
                 drop_copy: Callable[[Any], None], *, direct: bool | None = None) -> None:
        self.directory = os.fspath(directory)
        _check_directory(self.directory)
        self.budget_bytes = budget_bytes
        self.pool = pool
        self._finish = finish
        self._is_done = is_done
        self._drop_copy = drop_copy
        self._direct = direct
        self.store: DiskStore | None = None
        self._io: ThreadPoolExecutor | None = None
        self._host: OrderedDict[Any, None] = OrderedDict()  # evicted, their copy on host, oldest first
        # back on the device with their slab kept, and what drops that copy (``forget``s it here)
        self._returned: OrderedDict[Any, Callable[[Any], None]] = OrderedDict()
        self._reading: OrderedDict[Any, None] = OrderedDict()  # read back ahead of need, in start order
        self._spilled: dict[Any, _Spilled] = {}  # entry -> its copy written, on disk, or read back
        self._on_disk: OrderedDict[Any, None] = OrderedDict()  # entries wholly on disk, oldest spill first
        self._failed: BaseException | None = None  # a write failed this step: spilling stopped
        self._said_past_budget = False  # a read past the host budget was said this step
        self._ahead = True  # writes ahead of need (``begin_step``)
        self.copy_in: dict[int, int] | None = None  # the plan's order of copies back (``begin_step``)
        self._must_go: frozenset[int] | None = None  # the plan's copies that must go to disk (``begin_step``)
        self.origin = time.perf_counter()  # the step's start, for ``spans``
        self.spans: list[CopySpan] = []  # the step's writes and reads, for the timeline
        self.bytes_to_disk = 0
        self.bytes_from_disk = 0
        self.demand_reads = 0
        self.write_s = 0.0  # time the I/O thread spent writing / reading this step's bytes
        self.read_s = 0.0

    # --- what the residency manager calls -------------------------------------------
    def acquire(self, nbytes: int) -> tuple[torch.Tensor, Any] | None:
        """A host slab for ``nbytes`` (and the event of its last copy), within the budget when
        spilling can make the room; None when neither the budget nor the pool has it."""
        self.make_room(aligned(max(nbytes, 1)))
        got = self.pool.acquire_with_event(nbytes)
        while got is None:  # the pool's cap: room in fragments, freed until one holds the slab
            if self._returned:
                self._drop_oldest_copy()
            elif not self._spill_oldest(wait=True) and not self._unprefetch_latest():
                break  # nothing left to free
            got = self.pool.acquire_with_event(nbytes)
        return got

    def evicted(self, entry: Any) -> None:
        """``entry`` left the device with a current host copy: it may be spilled."""
        self._returned.pop(entry, None)
        self._host[entry] = None
        self._host.move_to_end(entry)
        self._spill_ahead()

    def holds(self, entry: Any) -> bool:
        return entry in self._spilled

    def bring_to_host(self, entry: Any) -> None:
        """``entry.host`` holds its bytes on return (read now if no read was started; past the
        host budget, said once a step, where copies that cannot be written out hold all of it)."""
        self._host.pop(entry, None)
        self._reading.pop(entry, None)
        rec = self._spilled.get(entry)
        if rec is None:
            return
        if not rec.writing and rec.future is None:  # on disk and not asked for yet: read it now
            got = self.acquire(rec.nbytes)
            if got is None:  # copies on their way out hold the budget: the step needs these bytes
                got = self.pool.acquire_with_event(rec.nbytes, past_cap=True)  # now, past it
                assert got is not None
                self._say_past_budget(entry.sid, rec.nbytes)
            self.demand_reads += 1
            self._on_disk.pop(entry, None)
            self._start_read(rec, got)
        del self._spilled[entry]
        future, rec.future = rec.future, None
        assert future is not None
        try:
            done = future.result()
        except BaseException as exc:
            if rec.writing:  # the slab still has the bytes: nothing was lost
                logger.debug("a disk write no longer needed failed: %s", exc)
            else:  # the read failed: those bytes are lost, the slab goes back
                self._free_extent(rec)
                if rec.slab is not None:
                    self.pool.release(rec.slab, None)
                rec.slab = None
                raise
        else:
            self._timed(rec, done)  # a write: for nothing, the slab still has the bytes
        entry.host, entry.host_event = rec.slab, None
        rec.slab = None
        self._free_extent(rec)

    def returned(self, entry: Any, drop: Callable[[Any], None] | None = None) -> None:
        """``entry`` is on the device again and keeps its host slab, which ``drop(entry)``
        (default: the manager's) gives back when room is short; host room it freed may take
        spilled copies back."""
        self._returned[entry] = drop or self._drop_copy
        self.prefetch()

    def prefetch(self) -> None:
        """Start reading the most recently spilled copies back while host room allows."""
        if not self._on_disk:
            return
        self._collect()
        limit = int(READ_AT * self.budget_bytes)
        for entry in self._read_order():
            rec = self._spilled[entry]
            need = self.pool.in_use_bytes + aligned(rec.nbytes) - limit
            while need > 0 and self._drop_settled_copy():
                need = self.pool.in_use_bytes + aligned(rec.nbytes) - limit
            if need > 0:
                break
            got = self.pool.acquire_with_event(rec.nbytes)
            if got is None:
                break
            del self._on_disk[entry]
            self._reading[entry] = None
            self._start_read(rec, got)

    def forget(self, entry: Any) -> None:
        """The storage died or its host copy is dropped: its writes and reads end, its room returns."""
        self._host.pop(entry, None)
        self._returned.pop(entry, None)
        self._reading.pop(entry, None)
        self._on_disk.pop(entry, None)
        rec = self._spilled.pop(entry, None)
        if rec is None:
            return
        if rec.future is not None and not rec.future.cancel():
            try:
                done = rec.future.result()
            except Exception as exc:  # nothing to keep: the storage is gone
                logger.debug("disk I/O of a forgotten storage failed: %s", exc)
            else:
                self._timed(rec, done)
        if rec.slab is not None and rec.slab is not entry.host:
            self.pool.release(rec.slab, None)
        rec.slab = None
        self._free_extent(rec)

    def begin_step(self, copy_in: dict[int, int] | None = None, ahead: bool = True,
                   must_go: frozenset[int] | None = None) -> None:
        """The step's counters from zero; a write failure is tried (and said) again. ``copy_in``:
        the plan's op of each storage's copy back to the device (``ir.packed_schedule.last_copy_in``),
        by which copies are spilled (the one needed last first) and read back (the one needed
        first first); None (the first step, no plan yet): by age, oldest out, newest back.
        ``ahead``: write copies out ahead of need past ``SPILL_AT``; off where the plan's host
        copies fit the budget (they are then written only if room runs short after all).
        ``must_go``: the storages whose copies the plan's disk plan writes (``planning.disk_plan``):
        writes ahead of need take only these (room that runs short after all takes any)."""
        self.copy_in = copy_in
        self._ahead = ahead
        self._must_go = must_go
        self.origin = time.perf_counter()
        self.spans = []
        self._failed = None
        self._said_past_budget = False
        self.bytes_to_disk = self.bytes_from_disk = self.demand_reads = 0
        self.write_s = self.read_s = 0.0

    def close_file(self) -> None:
        """Unlink the store's file (after a failed step, or for good); reopened at the next spill."""
        store, self.store = self.store, None
        if store is not None:
            store.close()

    def close(self) -> None:
        self.close_file()
        io, self._io = self._io, None
        if io is not None:
            io.shutdown(wait=True)

    @property
    def held_bytes(self) -> int:
        """Host bytes of the tier itself: the store's staging buffer, where it made one (the
        session's page-aligned slabs move without it)."""
        return 0 if self.store is None else self.store.staging_bytes

    # --- spilling -------------------------------------------------------------------
    def make_room(self, size: int) -> None:
        """Slabs in use plus ``size`` within the budget, waiting for writes if need be."""
        self._collect()
        target = self.budget_bytes - size
        while self.pool.in_use_bytes > target and self._returned:
            self._drop_oldest_copy()
        if self.pool.in_use_bytes <= target:
            return
        self._spill_until(target)
        while self.pool.in_use_bytes > target and self._wait_oldest_write():
            pass

    def _spill_ahead(self) -> None:
        if self._ahead and self.pool.in_use_bytes > SPILL_AT * self.budget_bytes:
            self._collect()
            self._spill_until(int(SPILL_AT * self.budget_bytes), self._must_go)

    def _spill_until(self, target: int, among: frozenset[int] | None = None) -> None:
        """Start writes, oldest copy first, until the slabs not being written fit ``target``
        (``among``: copies of these storages only)."""
        writing = sum(aligned(r.nbytes) for r in self._spilled.values() if r.writing)
        while self.pool.in_use_bytes - writing > target and self._failed is None:
            size = self._spill_oldest(wait=False, among=among)
            if not size:
                return
            writing += size

    def _spill_oldest(self, wait: bool, among: frozenset[int] | None = None) -> int:
        """Start writing the oldest host copy (``wait``: and wait for it; ``among``: of these
        storages); its slab's size, 0 if none."""
        host = list(self._host) if among is None else [e for e in self._host if e.sid in among]
        if self._failed is not None or not host:
            return 0 if not wait else int(self._wait_oldest_write())
        entry = self._latest_needed([e for e in host if e.nbytes >= SMALL_BYTES] or host)
        del self._host[entry]
        if entry.host_event is not None:
            self._finish(entry.host_event)  # its copy off the device has written the slab
            entry.host_event = None
        rec = _Spilled(nbytes=entry.nbytes, sid=entry.sid, slab=entry.host, writing=True)
        entry.host = None  # the tier holds the slab until the write is collected
        if self.store is None:
            self.store = DiskStore(self.directory, direct=self._direct)
        if self._io is None:
            self._io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hyperpar-disk")
        assert rec.slab is not None
        rec.future = self._io.submit(_timed_call, self.store.write, self._span(rec.slab, rec.nbytes))
        self._spilled[entry] = rec
        if wait:
            self._collect(rec.future)
        return aligned(rec.nbytes)

    def _drop_settled_copy(self) -> bool:
        """Drop the oldest host copy of a storage back on the device whose copy in is done (one
        still in flight would make the compute side wait); False when there is none."""
        for entry, drop in self._returned.items():
            if entry.h2d_event is None or self._is_done(entry.h2d_event):
                drop(entry)
                self._returned.pop(entry, None)
                return True
        return False

    def _drop_oldest_copy(self) -> None:
        entry, drop = next(iter(self._returned.items()))
        drop(entry)
        self._returned.pop(entry, None)  # a drop that kept the copy must not come round again

    def _unprefetch_latest(self) -> bool:
        """Give back the slab of the read started last (its copy stays on disk, first to be read
        again): room a copy needed sooner takes. False when no read is ahead of need."""
        if not self._reading:
            return False
        entry = self._latest_needed(self._reading)
        del self._reading[entry]
        rec = self._spilled[entry]
        future, rec.future = rec.future, None
        if future is not None and not future.cancel():
            try:
                self._timed(rec, future.result())
            except Exception as exc:  # the extent still holds the bytes
                logger.debug("a read ahead of need failed: %s", exc)
        if rec.slab is not None:
            self.pool.release(rec.slab, None)
        rec.slab = None
        self._on_disk[entry] = None  # the newest again: read back first
        return True

    def _latest_needed(self, entries: Iterable[Any]) -> Any:
        """Of ``entries`` (oldest first), the one the plan copies back last (one it never copies
        back, before any), or without a plan the oldest."""
        copy_in = self.copy_in
        if copy_in is None:
            return next(iter(entries))
        return max(entries, key=lambda e: copy_in.get(e.sid, _NEVER))

    def _read_order(self) -> list[Any]:
        """Copies on disk in the order to read them back: by the plan's copy back, else newest first."""
        copy_in = self.copy_in
        if copy_in is None:
            return list(reversed(self._on_disk))
        return sorted(self._on_disk, key=lambda e: copy_in.get(e.sid, _NEVER))

    def _wait_oldest_write(self) -> bool:
        for rec in self._spilled.values():
            if rec.writing and rec.future is not None:
                self._collect(rec.future)
                return True
        return False

    def _collect(self, wait_for: Future[Any] | None = None) -> None:
        """Finished writes give their slabs back to the pool (``wait_for``: that one first)."""
        if wait_for is not None:
            try:
                wait_for.result()
            except Exception:
                pass  # handled below, with the others
        for entry, rec in list(self._spilled.items()):
            if not rec.writing or rec.future is None or not rec.future.done():
                continue
            exc = rec.future.exception()
            if exc is None:
                self._timed(rec, rec.future.result())
            rec.future, rec.writing = None, False
            if exc is not None:  # the bytes are still in the slab: keep them on host
                del self._spilled[entry]
                entry.host = rec.slab
                self._host[entry] = None
                self._host.move_to_end(entry, last=False)
                self._fail(exc)
                continue
            assert rec.slab is not None
            self.pool.release(rec.slab, None)
            rec.slab = None
            self.bytes_to_disk += rec.nbytes
            self._on_disk[entry] = None

    def _say_past_budget(self, sid: int, nbytes: int) -> None:
        if not self._said_past_budget:
            self._said_past_budget = True
            logger.warning("hyperpar disk tier: no room in the host budget of %d bytes (%d in use by "
                           "copies that cannot be written out now) to read storage %d (%d bytes) back; "
                           "read past the budget (StepReport.peak_host_bytes shows by how much)",
                           self.budget_bytes, self.pool.in_use_bytes, sid, nbytes)

    def _fail(self, exc: BaseException) -> None:
        if self._failed is None:
            logger.warning("hyperpar disk tier: writing to %s failed (%s); spilling stops for this step, "
                           "host copies stay on host and what the host budget cannot hold stays on "
                           "the device", self.directory, exc)
        self._failed = exc

    # --- reading back ---------------------------------------------------------------
    def _start_read(self, rec: _Spilled, got: tuple[torch.Tensor, Any]) -> None:
        slab, after = got
        if after is not None and not self._is_done(after):
            self._finish(after)  # the slab's last copy still reads it
        assert rec.extent is not None and self.store is not None and self._io is not None
        rec.slab = slab
        rec.future = self._io.submit(_timed_call, self.store.read, rec.extent, self._span(slab, rec.nbytes))
        self.bytes_from_disk += rec.nbytes

    def _span(self, slab: torch.Tensor, nbytes: int) -> torch.Tensor:
        """The bytes of a slab that go to disk and back: ``nbytes`` rounded up to the pool's
        alignment, so page-aligned slabs move in place under direct I/O (the tail is padding)."""
        return slab[:min(slab.numel(), self.pool.aligned(nbytes))]

    def _timed(self, rec: _Spilled, done: tuple[Extent | None, float, float]) -> None:
        """A finished transfer's result: a write's extent, and the I/O thread's time on it."""
        value, t0, t1 = done
        if rec.writing:
            rec.extent = value
            self.write_s += t1 - t0
        else:
            self.read_s += t1 - t0
        self.spans.append(CopySpan(DISK_WRITE_LANE if rec.writing else DISK_READ_LANE, rec.sid, rec.nbytes,
                                   (t0 - self.origin) * 1e3, (t1 - self.origin) * 1e3))

    def _free_extent(self, rec: _Spilled) -> None:
        extent, rec.extent = rec.extent, None
        if extent is not None and self.store is not None:
            self.store.free(extent)


def _timed_call(fn: Callable[..., Any], *args: Any) -> tuple[Any, float, float]:
    """On the I/O thread: ``fn(*args)``, and when it started and ended (``perf_counter``)."""
    t0 = time.perf_counter()
    value = fn(*args)
    return value, t0, time.perf_counter()
