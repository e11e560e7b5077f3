"""What a disk tier would do with a plan: host bytes over the step, bytes to and from disk, I/O time.

The runtime's ``DiskTier`` decides as the step goes (room, the order the plan brings copies
back, and the copies the plan's disk plan says must go, which it is given), so a plan does not
say when it will spill; this replays the same policy on the schedule's actions, in order
(``planning.tier_model``, with the runtime's two marks), to tell before a run whether a host
budget is worth a disk tier:

- a host copy is taken at its COPY_D2H and becomes spillable at its RELEASE_DEVICE (evicted);
  a COPY_D2H of a storage whose host copy is still held takes no new room;
- room for a new copy is made by dropping copies of storages back on the device (oldest
  first), then by writing to disk the evicted copy the plan brings back last (its last
  COPY_H2D; never, first), as the runtime does on every step with a plan (``copy_in``);
- after an eviction, once copies in use pass ``SPILL_AT`` of the budget, evicted copies are
  written in that order until they are back under it, of the copies the disk plan says must
  go only (``disk_plan``; any without it, as on the first step), unless the plan's host copies
  fit the budget (``host_peak``): then, as at runtime, only room that runs short is written for;
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

from dataclasses import asdict, dataclass, field
from typing import Any

from hyperpar.offload.ir import ActivationTrace, ResidencySchedule
from hyperpar.offload.planning.disk_plan import plan_disk
from hyperpar.offload.planning.simulate import SimResult
from hyperpar.offload.planning.tier_model import (
    READ_AT,
    SMALL_BYTES,
    SPILL_AT,
    DiskClock,
    TierModel,
    carved_sizes,
)

__all__ = ["READ_AT", "SMALL_BYTES", "SPILL_AT", "HostTierEstimate", "host_peak", "host_tier"]
WAIT_SAID = 0.05  # timed waits for the disk over this share of the step are said
# The raw O_DIRECT figures of benchmarks/results/disk_store.json on this repository's CI machine
# before huge pages (from 4 KiB pages; on huge pages it measured 3.85 / 3.92): a disk's floor.
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
              read_gbps: float = DEFAULT_READ_GBPS, timeline: SimResult | None = None,
              disk_plan: bool = True) -> HostTierEstimate:
    """Estimate the disk tier's work for ``schedule`` on ``trace`` with ``host_budget_bytes`` of
    host; ``timeline``: the schedule's simulation (``planning.simulate``), to time the disk link;
    ``disk_plan``: the tier writes ahead of need only the copies the schedule's disk plan says
    must go (``planning.disk_plan``), as the runtime does on every step with a plan; False: any
    (its policy on a step without a plan, the first)."""
    if schedule.num_ops != trace.num_ops:
        raise ValueError(f"schedule has {schedule.num_ops} ops but the trace has {trace.num_ops}")
    if host_budget_bytes < 0 or write_gbps <= 0 or read_gbps <= 0:
        raise ValueError(f"need host_budget_bytes >= 0 and bandwidths > 0, got {host_budget_bytes}, "
                         f"{write_gbps}, {read_gbps}")
    listed = schedule.actions()
    actions = [a for _, _, a in listed]
    unbounded = TierModel(trace.storage_sizes, None, actions)
    unbounded.run()
    ahead = unbounded.peak > host_budget_bytes
    among = plan_disk(trace, schedule, host_budget_bytes).must_go if ahead and disk_plan else None
    tier = TierModel(trace.storage_sizes, host_budget_bytes, actions, ahead=ahead, among=among)
    if timeline is not None:
        if len(timeline.op_start_ms) != trace.num_ops:
            raise ValueError(f"timeline has {len(timeline.op_start_ms)} ops but the trace has "
                             f"{trace.num_ops}")
        tier.clock = DiskClock([timeline.op_start_ms[op] if where == "pre" else timeline.op_end_ms[op]
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
    actions = [a for _, _, a in schedule.actions()]
    unbounded = TierModel(carved_sizes(trace.storage_sizes, align), None, actions)
    unbounded.run()
    return unbounded.peak
