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

The room it finds ignores time: reads ahead are never taken back for room, slabs are not
rounded up to the pool's alignment, a tail's copy that Python holds past its release is not
counted, and the store's staging buffer is left out. ``fits`` says only that the I/O thread's
work (writes then reads, one thread) is no longer than the step's compute: a necessary
condition for hiding it. Given the plan's simulated op times (``timeline``), it also times the
disk link as the runtime meets it: one I/O thread runs the writes and reads in the order the
tier starts them, each at its bandwidth, a read no sooner than its copy's write ended; the
step waits where the runtime's compute thread blocks (a copy out whose room is a write still
running, a copy back whose read has not ended, a read on demand), and every later action
starts that much later (``disk_wait_ms``).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import asdict, dataclass, field
from typing import Any

from hyperpar.offload.ir import ActivationTrace, ResidencySchedule
from hyperpar.offload.ir import ResidencyActionType as Act
from hyperpar.offload.planning.simulate import SimResult

_NEVER = 1 << 62
SPILL_AT = 0.5  # as runtime.disk_tier.SPILL_AT
READ_AT = 0.75  # as runtime.disk_tier.READ_AT
WAIT_SAID = 0.05  # timed waits for the disk over this share of the step are said
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
    # given the plan's op times: how long the step waits for the disk (None: not timed), and
    # for what: room in slabs still being written, reads ahead not ended, reads on demand
    disk_wait_ms: float | None = None
    disk_wait_room_ms: float | None = None
    disk_wait_read_ahead_ms: float | None = None
    disk_wait_on_demand_ms: float | None = None
    step_ms: float | None = None  # the plan's predicted step, without the disk's waits

    @property
    def io_ms(self) -> float:
        """The I/O thread's time: writes and reads share one thread."""
        return self.write_ms + self.read_ms

    @property
    def fits(self) -> bool:
        return self.io_ms <= self.compute_ms

    @property
    def step_with_disk_ms(self) -> float | None:
        """The plan's predicted step plus its waits for the disk (timed estimates only)."""
        if self.disk_wait_ms is None or self.step_ms is None:
            return None
        return self.step_ms + self.disk_wait_ms

    def warning(self, step_ms: float) -> str | None:
        """What a user of this host budget should hear before the steps, or None: I/O the step
        cannot hide (``step_ms``: the plan's predicted step; timed, waits of more than
        ``WAIT_SAID`` of it), or copies no room is left for."""
        mib = 1 << 20
        said = []
        if self.disk_wait_ms is not None:
            if self.disk_wait_ms > WAIT_SAID * step_ms:
                said.append(f"the step waits {self.disk_wait_ms:.1f} ms for the disk tier's I/O "
                            f"({self.bytes_to_disk / mib:.1f} MiB written at {self.write_gbps:.2f} GB/s, "
                            f"{self.bytes_from_disk / mib:.1f} MiB read at {self.read_gbps:.2f} GB/s) on "
                            f"top of its {step_ms:.1f} ms")
        elif self.io_ms > step_ms and self.bytes_to_disk:
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
        return {**doc, "io_ms": self.io_ms, "fits": self.fits, "step_with_disk_ms": self.step_with_disk_ms}


def host_tier(trace: ActivationTrace, schedule: ResidencySchedule, host_budget_bytes: int,
              write_gbps: float = DEFAULT_WRITE_GBPS,
              read_gbps: float = DEFAULT_READ_GBPS, timeline: SimResult | None = None) -> HostTierEstimate:
    """Estimate the disk tier's work for ``schedule`` on ``trace`` with ``host_budget_bytes`` of
    host; ``timeline``: the schedule's simulation (``planning.simulate``), to time the disk link."""
    if schedule.num_ops != trace.num_ops:
        raise ValueError(f"schedule has {schedule.num_ops} ops but the trace has {trace.num_ops}")
    if host_budget_bytes < 0 or write_gbps <= 0 or read_gbps <= 0:
        raise ValueError(f"need host_budget_bytes >= 0 and bandwidths > 0, got {host_budget_bytes}, "
                         f"{write_gbps}, {read_gbps}")
    listed = schedule.actions()
    actions = [a for _, _, a in listed]
    unbounded = _Tier(trace.storage_sizes, None, actions)
    unbounded.run()
    tier = _Tier(trace.storage_sizes, host_budget_bytes, actions, ahead=unbounded.peak > host_budget_bytes)
    if timeline is not None:
        if len(timeline.op_start_ms) != trace.num_ops:
            raise ValueError(f"timeline has {len(timeline.op_start_ms)} ops but the trace has "
                             f"{trace.num_ops}")
        tier.clock = _DiskClock([timeline.op_start_ms[op] if where == "pre" else timeline.op_end_ms[op]
                                 for op, where, _ in listed], write_gbps, read_gbps)
    tier.run()
    clock = tier.clock
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
        disk_wait_ms=None if clock is None else clock.waited,
        disk_wait_room_ms=None if clock is None else clock.by_cause["room"],
        disk_wait_read_ahead_ms=None if clock is None else clock.by_cause["read_ahead"],
        disk_wait_on_demand_ms=None if clock is None else clock.by_cause["on_demand"],
        step_ms=None if timeline is None else timeline.predicted_step_ms,
    )


def host_peak(trace: ActivationTrace, schedule: ResidencySchedule, align: int = 1) -> int:
    """The most host bytes ``schedule``'s copies hold at once without a host budget, each copy's
    slab ``align``-rounded as the host pool carves it: a host budget at or above it needs no
    disk (the runtime then writes nothing ahead of need)."""
    sizes = {sid: -(-n // align) * align for sid, n in trace.storage_sizes.items()}
    unbounded = _Tier(sizes, None, [a for _, _, a in schedule.actions()])
    unbounded.run()
    return unbounded.peak


class _DiskClock:
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


class _Tier:
    """The runtime tier's bookkeeping without slabs or threads (``budget`` None: no budget);
    timed where a ``clock`` is set."""

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
        self.clock: _DiskClock | None = None

    def run(self) -> None:
        clock = self.clock
        for i, action in enumerate(self.actions):
            if clock is not None:
                clock.at(i)
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

    def spill_until(self, target: int) -> None:
        """Write evicted copies (the one the plan brings back last first) until in use is down
        to ``target``."""
        while self.in_use > target and self.host:
            sid = max(self.host, key=self._comes_back)  # the one the plan brings back last
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
