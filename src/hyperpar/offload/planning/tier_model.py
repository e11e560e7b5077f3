"""The runtime disk tier's bookkeeping without slabs or threads, and its I/O thread in time.

``planning.host_tier`` replays the runtime's policy with it (its estimate), and
``planning.disk_plan`` finds with it the copies a plan must write. Planning may not import the
runtime, so its marks are copied here (a test checks they still match ``runtime.disk_tier``).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from hyperpar.offload.ir import ResidencyActionType as Act

_NEVER = 1 << 62
SPILL_AT = 0.5  # as runtime.disk_tier.SPILL_AT
READ_AT = 0.75  # as runtime.disk_tier.READ_AT
SMALL_BYTES = 256 << 10  # as runtime.disk_tier.SMALL_BYTES


def carved_sizes(storage_sizes: dict[int, int], align: int) -> dict[int, int]:
    """Each storage's copy as the host pool carves it: its bytes rounded up to ``align``."""
    return {sid: -(-n // align) * align for sid, n in storage_sizes.items()}


class DiskClock:
    """The tier's one I/O thread in time: ``issued[i]`` is when action ``i`` runs on the plan's
    timeline, pushed later by what the step has waited so far."""

    def __init__(self, issued: list[float], write_gbps: float, read_gbps: float) -> None:
        self.issued = issued
        self.write_ms_per_byte, self.read_ms_per_byte = 1 / (write_gbps * 1e6), 1 / (read_gbps * 1e6)
        self.now = self.waited = self.free = 0.0
        self.written: dict[int, float] = {}  # sid -> when its write ends
        self.read: dict[int, float] = {}  # sid -> when its read ends
        self.writing: list[tuple[float, int]] = []  # (end, bytes) of writes whose slab is not free yet
        self.by_cause = {"room": 0.0, "read_ahead": 0.0, "on_demand": 0.0}

    def at(self, i: int) -> None:
        self.now = self.issued[i] + self.waited

    def write(self, sid: int, size: int) -> float:
        begin = max(self.now, self.free)
        self.free = self.written[sid] = begin + size * self.write_ms_per_byte
        self.writing.append((self.free, size))
        return self.free

    def room(self, free_bytes: int) -> None:
        """A slab of what the count calls free (``free_bytes``) is taken: slabs still being
        written are not free until their writes end (the oldest end first)."""
        writing = [w for w in self.writing if w[0] > self.now]
        short = sum(size for _, size in writing) - free_bytes
        for end, size in writing:  # (in the order they were started: ends ascending)
            if short <= 0:
                break
            self.wait_until(end, "room")
            short -= size
        self.writing = [w for w in writing if w[0] > self.now]

    def start_read(self, sid: int, size: int) -> float:
        begin = max(self.now, self.free, self.written.get(sid, 0.0))
        self.free = self.read[sid] = begin + size * self.read_ms_per_byte
        return self.free

    def wait_until(self, t: float, cause: str) -> None:
        """The compute thread blocks until ``t`` (for ``cause``, a key of ``by_cause``)."""
        if t > self.now:
            self.waited += t - self.now
            self.by_cause[cause] += t - self.now
            self.now = t


class TierModel:
    """The runtime tier's bookkeeping without slabs or threads (``budget`` None: no budget);
    timed where a ``clock`` is set."""

    def __init__(self, sizes: dict[int, int], budget: int | None, actions: list[Any],
                 ahead: bool = True, among: frozenset[int] | None = None) -> None:
        self.ahead = ahead  # writes ahead of need (off where the copies fit the budget, as at runtime)
        self.among = among  # writes ahead of need take only these (a disk plan's), else any
        self.sizes, self.budget, self.actions = sizes, budget, actions
        self.held: dict[int, int] = {}  # copied, still on the device: not spillable
        self.host: OrderedDict[int, int] = OrderedDict()  # evicted, copy on host, oldest first
        self.returned: OrderedDict[int, int] = OrderedDict()  # back on the device, copy kept
        self.reading: dict[int, int] = {}  # read back ahead of need
        self.on_disk: OrderedDict[int, int] = OrderedDict()  # oldest spill first
        self.in_use = self.peak = self.to_disk = self.from_disk = self.demand_reads = 0
        self.kept_on_device = self.on_disk_bytes = self.disk_peak = 0
        self.kept: set[int] = set()  # storages whose copy the budget could not hold
        self.spilled: list[int] = []
        last_h2d = {a.storage_id: i for i, a in enumerate(actions) if a.kind is Act.COPY_H2D}
        self.last_h2d = last_h2d
        self.clock: DiskClock | None = None

    def run(self) -> None:
        for i, action in enumerate(self.actions):
            self.step(action, i)

    def step(self, action: Any, i: int) -> None:
        """Action ``i`` of the schedule."""
        if self.clock is not None:
            self.clock.at(i)
        sid, kind = action.storage_id, action.kind
        if kind is Act.COPY_D2H:
            self.copy_out(sid)
        elif kind is Act.RELEASE_DEVICE:
            self.release_device(sid, final=self.last_h2d.get(sid, -1) < i)
        elif kind is Act.COPY_H2D:
            self.copy_in(sid)
        else:
            self.forget(sid)

    # --- the actions ----------------------------------------------------------------
    def copy_out(self, sid: int) -> None:
        self.kept.discard(sid)
        if sid in self.held:
            return
        if sid in self.returned:  # the slab is reused: no new room
            self.held[sid] = self.returned.pop(sid)
            return
        size = self.sizes.get(sid, 0)
        if not self.make_room(size):
            self.kept.add(sid)
            self.kept_on_device += size
            return
        self.held[sid] = size
        self.take(size)

    def release_device(self, sid: int, final: bool) -> None:
        if final:  # never read back: its copy is not needed
            self.forget(sid)
            return
        size = self.held.pop(sid, None)
        if size is None:
            size = self.returned.pop(sid, None)
        if size is None:  # no copy (the budget held none, or it was dropped): stays on the device
            if sid not in self.kept:
                self.kept.add(sid)
                self.kept_on_device += self.sizes.get(sid, 0)
            return
        self.host[sid] = size
        if self.ahead and self.budget is not None and self.in_use > SPILL_AT * self.budget:
            self.spill_until(int(SPILL_AT * self.budget), self.among)

    def copy_in(self, sid: int) -> None:
        if sid in self.kept:
            return
        if sid in self.host:
            size = self.host.pop(sid)
        elif sid in self.reading:
            size = self.reading.pop(sid)
            self.on_disk_bytes -= size  # its extent is freed once the copy is back on host
            if self.clock is not None:  # the copy back waits for the read to end
                self.clock.wait_until(self.clock.read.get(sid, 0.0), "read_ahead")
        elif sid in self.on_disk:
            size = self.on_disk.pop(sid)
            self.on_disk_bytes -= size
            self.make_room(size)  # the device waits for it (where no room can be made the runtime raises)
            self.take(size)
            self.from_disk += size
            self.demand_reads += 1
            if self.clock is not None:
                self.clock.wait_until(self.clock.start_read(sid, size), "on_demand")
        else:
            return
        self.returned[sid] = size
        self.read_ahead(in_flight=sid)

    def forget(self, sid: int) -> None:
        self.kept.discard(sid)
        self.on_disk_bytes -= self.on_disk.pop(sid, 0)
        if sid in self.reading:
            self.on_disk_bytes -= self.reading[sid]
        for where in (self.held, self.host, self.returned, self.reading):
            size = where.pop(sid, None)
            if size is not None:
                self.in_use -= size

    # --- room -----------------------------------------------------------------------
    def take(self, size: int) -> None:
        self.in_use += size
        self.peak = max(self.peak, self.in_use)

    def make_room(self, size: int) -> bool:
        """Copies in use plus ``size`` within the budget: drop copies back on the device, then
        spill the oldest evicted ones. False when that is not enough."""
        if self.budget is None:
            return True
        target = self.budget - size
        while self.in_use > target and self.returned:
            self.in_use -= self.returned.popitem(last=False)[1]
        self.spill_until(target)
        if self.clock is not None and self.in_use <= target:  # room in slabs still being written waits
            self.clock.room(target - self.in_use)
        return self.in_use <= target

    def spill_until(self, target: int, among: frozenset[int] | None = None) -> None:
        """Write evicted copies (the one the plan brings back last first; ``among``: of these
        storages only) until in use is down to ``target``."""
        while self.in_use > target:
            host = list(self.host) if among is None else [sid for sid in self.host if sid in among]
            if not host:
                return
            large = [sid for sid in host if self.sizes.get(sid, 0) >= SMALL_BYTES]
            self.write(max(large or host, key=self._comes_back))  # the one the plan brings back last

    def write(self, sid: int) -> None:
        """Write ``sid``'s evicted copy to disk."""
        size = self.host.pop(sid)
        self.in_use -= size
        self.to_disk += size
        self.on_disk[sid] = size
        self.spilled.append(sid)
        self.on_disk_bytes += size
        self.disk_peak = max(self.disk_peak, self.on_disk_bytes)
        if self.clock is not None:
            self.clock.write(sid, size)

    def read_ahead(self, in_flight: int) -> None:
        """Read the newest spilled copies back while in use stays under ``READ_AT`` of the budget."""
        assert self.budget is not None or not self.on_disk
        limit = READ_AT * (self.budget or 0)
        while self.on_disk:
            sid = min(self.on_disk, key=self._comes_back)  # the one the plan brings back first
            size = self.on_disk[sid]
            while self.in_use + size > limit and self._drop_settled(in_flight):
                pass
            if self.in_use + size > limit:
                return
            del self.on_disk[sid]
            self.reading[sid] = size
            self.take(size)
            self.from_disk += size
            if self.clock is not None:
                self.clock.start_read(sid, size)

    def _comes_back(self, sid: int) -> int:
        """When the plan copies ``sid`` back to the device (its last COPY_H2D), or never."""
        return self.last_h2d.get(sid, _NEVER)

    def _drop_settled(self, in_flight: int) -> bool:
        for sid in self.returned:
            if sid != in_flight:
                self.in_use -= self.returned.pop(sid)
                return True
        return False
