"""The disk tier's part of a plan: which host copies must go to disk at all.

Without a plan the runtime tier writes copies out ahead of need whenever the host budget is
more than half full, oldest-needed first, so that room is there when a copy out asks. It
cannot know whether room will be asked again: at the end of forward the budget is full
because nothing more is coming, and it writes copies that could have stayed, among them the
ones backward needs first, which backward then waits to read. On the demo's GPT (batch 32,
device budget half its peak) with a host budget of half the bytes a step moves, it wrote
100.5 MiB a step where the plan below writes 62-70.

The plan knows the whole step. It replays the schedule's actions with writes only where room
runs short (a copy out or a read the budget cannot hold), taking the evicted copy the
schedule brings back last, as Belady's rule asks: the copies that must go, and no copy the
budget could have held. The runtime keeps writing ahead of need (a write started early is
room in time), but only these copies (``DiskTier.begin_step(must_go=...)``); room that runs
short after all is still made from any copy, so the plan is never needed for correctness.

Tried and left (see ``docs/architecture.md``): writing each of these copies as soon as it
leaves the device and starting each read at the earliest action the model finds room for.
The model predicted no waits; at runtime the host pool's free room was in pieces (slabs of
several sizes in one arena) where the model counts bytes, so copies out found no room and
fast steps fell back, and reads found less room than the model (copies back on the device
are dropped only once their copy in is done) and were read on demand.
"""

from __future__ import annotations

from dataclasses import dataclass

from hyperpar.offload.ir import ActivationTrace, ResidencySchedule
from hyperpar.offload.planning.tier_model import TierModel, carved_sizes


@dataclass(frozen=True)
class DiskPlan:
    """The copies a step must write to disk at ``host_budget_bytes`` of host (storage ids), and
    their bytes (each copy's slab as the pool carves it)."""

    host_budget_bytes: int
    must_go: frozenset[int]
    bytes_to_disk: int


def plan_disk(trace: ActivationTrace, schedule: ResidencySchedule, host_budget_bytes: int,
              align: int = 1) -> DiskPlan:
    """The disk plan of ``schedule`` on ``trace`` with ``host_budget_bytes`` of host, each copy's
    slab ``align``-rounded as the host pool carves it."""
    if host_budget_bytes < 0:
        raise ValueError(f"host_budget_bytes must be >= 0, got {host_budget_bytes}")
    if align < 1:
        raise ValueError(f"align must be >= 1, got {align}")
    need = _AtNeed(carved_sizes(trace.storage_sizes, align), host_budget_bytes,
                   [a for _, _, a in schedule.actions()], ahead=False)
    need.run()
    return DiskPlan(host_budget_bytes, frozenset(need.spilled), need.to_disk)


class _AtNeed(TierModel):
    """The tier (built with ``ahead=False``: writes only where room runs short) with every read
    on demand."""

    def read_ahead(self, in_flight: int) -> None:
        return None  # reads ahead take room that would then have to be made: not the plan's to count
