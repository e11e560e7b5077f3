"""What a disk tier would do with a plan: host bytes over the step, bytes to and from disk, I/O time.

The runtime's ``DiskTier`` decides as the step goes (room, and the order the plan brings copies
back, which it is given), so a plan does not say what it will spill; this replays the same
policy on the schedule's actions, in order, to tell before a run whether a host budget is worth
a disk tier. Planning may not import the runtime, so the two
marks are copied here (a test checks they still match ``runtime.disk_tier``):

- a host copy is taken at its COPY_D2H and becomes spillable at its RELEASE_DEVICE (evicted);
  a COPY_D2H of a storage whose host copy is still held takes no new room;
- room for a new copy is made by dropping copies of storages back on the device (oldest
  first), then by writing to disk the evicted copy the plan brings back last (its last
  COPY_H2D; never, first), as the runtime does on every step with a plan (``copy_in``);
- after an eviction, once copies in use pass ``SPILL_AT`` of the budget, evicted copies are
  written in that order until they are back under it, unless the plan's host copies fit the
  budget (``host_peak``): then, as at runtime, only room that runs short is written for;
- a COPY_H2D of a copy on disk reads it (a demand read); after every COPY_H2D the copies on
  disk the plan brings back first are read back while copies in use stay under ``READ_AT`` of
  the budget, dropping copies already back on the device (all but the one just brought in,
  still in flight) for room;
- a copy no room can be made for stays on the device (``kept_on_device_bytes``), as does a
  storage whose copy was dropped while it was back on the device and that leaves again;
- RELEASE_HOST, and the RELEASE_DEVICE after which a storage never comes back, free its copy.

It ignores time: writes and reads finish at once (the runtime's I/O thread may lag, and a slab
waits for its write), reads ahead are never taken back for room, slabs are not rounded up to
the pool's alignment, a tail's copy that Python holds past its release is not counted, and the
store's staging buffer is left out. ``fits`` says only that the I/O thread's work (writes then
reads, one thread) is no longer than the step's compute: a necessary condition for hiding it.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import asdict, dataclass, field
from typing import Any

from hyperpar.offload.ir import ActivationTrace, ResidencySchedule
from hyperpar.offload.ir import ResidencyActionType as Act

_NEVER = 1 << 62
SPILL_AT = 0.5  # as runtime.disk_tier.SPILL_AT
READ_AT = 0.75  # as runtime.disk_tier.READ_AT
# The raw O_DIRECT figures of benchmarks/results/disk_store.json (this repository's CI machine).
DEFAULT_WRITE_GBPS = 2.49
DEFAULT_READ_GBPS = 1.60


@dataclass(frozen=True)
class HostTierEstimate:
    """A plan's host and disk tiers at one host budget (bytes; ms at the given GB/s)."""

    host_budget_bytes: int
    peak_host_bytes: int  # host copies in use at once without a host budget
    peak_host_bytes_budgeted: int  # the same within the budget (spilled copies not counted)
    bytes_to_disk: int
    peak_disk_bytes: int  # copies on disk at once (the store's file, before alignment)
    bytes_from_disk: int
    demand_reads: int  # copies the device needed before a read ahead had brought them
    kept_on_device_bytes: int  # copies the budget could not hold: they stay on the device
    write_gbps: float
    read_gbps: float
    write_ms: float
    read_ms: float
    compute_ms: float  # the trace's op times summed: the step the I/O must hide under
    spilled_sids: tuple[int, ...] = field(default=(), repr=False)  # written to disk, in order

    @property
    def io_ms(self) -> float:
        """The I/O thread's time: writes and reads share one thread."""
        return self.write_ms + self.read_ms

    @property
    def fits(self) -> bool:
        return self.io_ms <= self.compute_ms

    def warning(self, step_ms: float) -> str | None:
        """What a user of this host budget should hear before the steps, or None: I/O the step
        cannot hide (``step_ms``: the plan's predicted step), or copies no room is left for."""
        mib = 1 << 20
        said = []
        if self.io_ms > step_ms and self.bytes_to_disk:
            said.append(f"the disk tier's I/O ({self.bytes_to_disk / mib:.1f} MiB written at "
                        f"{self.write_gbps:.2f} GB/s and {self.bytes_from_disk / mib:.1f} MiB read at "
                        f"{self.read_gbps:.2f} GB/s: {self.io_ms:.1f} ms a step) is longer than the step "
                        f"({step_ms:.1f} ms), so steps will wait for the disk")
        if self.kept_on_device_bytes:
            said.append(f"{self.kept_on_device_bytes / mib:.1f} MiB of copies find no room in the host "
                        f"budget (copies on their way out hold it) and stay on the device, over its budget")
        if not said:
            return None
        return (f"host budget {self.host_budget_bytes / mib:.1f} MiB (the plan's host copies peak at "
                f"{self.peak_host_bytes / mib:.1f} MiB without one): " + "; ".join(said) +
                "; a larger host or device budget, or recompute, is cheaper")

    def as_dict(self) -> dict[str, Any]:
        doc = asdict(self)
        del doc["spilled_sids"]  # one per spill: long on a real step
        return {**doc, "io_ms": self.io_ms, "fits": self.fits}


def host_tier(trace: ActivationTrace, schedule: ResidencySchedule, host_budget_bytes: int,
              write_gbps: float = DEFAULT_WRITE_GBPS,
              read_gbps: float = DEFAULT_READ_GBPS) -> HostTierEstimate:
    """Estimate the disk tier's work for ``schedule`` on ``trace`` with ``host_budget_bytes`` of host."""
    if schedule.num_ops != trace.num_ops:
        raise ValueError(f"schedule has {schedule.num_ops} ops but the trace has {trace.num_ops}")
    if host_budget_bytes < 0 or write_gbps <= 0 or read_gbps <= 0:
        raise ValueError(f"need host_budget_bytes >= 0 and bandwidths > 0, got {host_budget_bytes}, "
                         f"{write_gbps}, {read_gbps}")
    actions = [a for _, _, a in schedule.actions()]
    unbounded = _Tier(trace.storage_sizes, None, actions)
    unbounded.run()
    tier = _Tier(trace.storage_sizes, host_budget_bytes, actions, ahead=unbounded.peak > host_budget_bytes)
    tier.run()
    return HostTierEstimate(
        host_budget_bytes=host_budget_bytes,
        peak_host_bytes=unbounded.peak,
        peak_host_bytes_budgeted=tier.peak,
        bytes_to_disk=tier.to_disk,
        peak_disk_bytes=tier.disk_peak,
        bytes_from_disk=tier.from_disk,
        demand_reads=tier.demand_reads,
        kept_on_device_bytes=tier.kept_on_device,
        write_gbps=write_gbps,
        read_gbps=read_gbps,
        write_ms=tier.to_disk / (write_gbps * 1e6),
        read_ms=tier.from_disk / (read_gbps * 1e6),
        compute_ms=sum(op.duration_ms for op in trace.ops),
        spilled_sids=tuple(tier.spilled),
    )


def host_peak(trace: ActivationTrace, schedule: ResidencySchedule, align: int = 1) -> int:
    """The most host bytes ``schedule``'s copies hold at once without a host budget, each copy's
    slab ``align``-rounded as the host pool carves it: a host budget at or above it needs no
    disk (the runtime then writes nothing ahead of need)."""
    sizes = {sid: -(-n // align) * align for sid, n in trace.storage_sizes.items()}
    unbounded = _Tier(sizes, None, [a for _, _, a in schedule.actions()])
    unbounded.run()
    return unbounded.peak


class _Tier:
    """The runtime tier's bookkeeping without slabs, threads or time (``budget`` None: no budget)."""

    def __init__(self, sizes: dict[int, int], budget: int | None, actions: list[Any],
                 ahead: bool = True) -> None:
        self.ahead = ahead  # writes ahead of need (off where the copies fit the budget, as at runtime)
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

    def run(self) -> None:
        for i, action in enumerate(self.actions):
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
            self.spill_until(int(SPILL_AT * self.budget))

    def copy_in(self, sid: int) -> None:
        if sid in self.kept:
            return
        if sid in self.host:
            size = self.host.pop(sid)
        elif sid in self.reading:
            size = self.reading.pop(sid)
            self.on_disk_bytes -= size  # its extent is freed once the copy is back on host
        elif sid in self.on_disk:
            size = self.on_disk.pop(sid)
            self.on_disk_bytes -= size
            self.make_room(size)  # the device waits for it (where no room can be made the runtime raises)
            self.take(size)
            self.from_disk += size
            self.demand_reads += 1
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
        return self.in_use <= target

    def spill_until(self, target: int) -> None:
        while self.in_use > target and self.host:
            sid = max(self.host, key=self._comes_back)  # the one the plan brings back last
            size = self.host.pop(sid)
            self.in_use -= size
            self.to_disk += size
            self.on_disk[sid] = size
            self.spilled.append(sid)
            self.on_disk_bytes += size
            self.disk_peak = max(self.disk_peak, self.on_disk_bytes)

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

    def _comes_back(self, sid: int) -> int:
        """When the plan copies ``sid`` back to the device (its last COPY_H2D), or never."""
        return self.last_h2d.get(sid, _NEVER)

    def _drop_settled(self, in_flight: int) -> bool:
        for sid in self.returned:
            if sid != in_flight:
                self.in_use -= self.returned.pop(sid)
                return True
        return False
