"""Which host copies the disk tier writes out and reads back first: the plan's order of copies
back to the device when there is a plan, age when there is none (``DiskTier.begin_step``).
Decided when a copy is evicted, before any I/O ends, so these checks do not depend on timing."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from hyperpar.offload.runtime import disk_tier
from hyperpar.offload.runtime.disk_tier import DiskTier
from hyperpar.offload.runtime.host_pool import HostPool

SLAB = 8192


class _Entry:
    """What the tier reads and sets of a residency entry."""

    def __init__(self, sid: int) -> None:
        self.sid, self.nbytes = sid, SLAB
        self.host: Any = None
        self.host_event: Any = None
        self.h2d_event: Any = None


def _tier(tmp_path: Path) -> tuple[DiskTier, HostPool]:
    pool = HostPool(4 * SLAB, align=4096)
    tier = DiskTier(tmp_path, 4 * SLAB, pool, finish=lambda event: None, is_done=lambda event: True,
                    drop_copy=lambda entry: None)
    return tier, pool


def _evict_four(tier: DiskTier) -> list[_Entry]:
    entries = [_Entry(sid) for sid in range(4)]
    for e in entries:
        got = tier.acquire(e.nbytes)
        assert got is not None
        e.host = got[0]
        tier.evicted(e)  # past half the budget, the next copy to spill starts writing
    return entries


@pytest.mark.parametrize(("copy_in", "written", "read_first"), [
    (None, [0, 1], 1),  # no plan: oldest out, newest back
    ({0: 40, 1: 10, 2: 30, 3: 20}, [0, 2], 2),  # the plan brings 0 back last, then 2; 2 is needed first
    ({1: 10, 2: 30, 3: 20}, [0, 2], 2),  # 0 never comes back: out first
])
def test_the_copy_needed_last_goes_out_first_and_comes_back_in_the_plans_order(
        tmp_path: Path, copy_in: dict[int, int] | None, written: list[int], read_first: int) -> None:
    tier, pool = _tier(tmp_path)
    tier.begin_step(copy_in)
    entries = _evict_four(tier)
    assert [e.sid for e in entries if e.host is None] == written  # their slabs are the tier's now
    for e in entries:  # the others go back to the device; their copies are dropped
        if e.host is not None:
            tier.bring_to_host(e)
            tier.forget(e)
            pool.release(e.host)
            e.host = None
    tier.make_room(4 * SLAB)  # room for the whole budget: waits for the writes to end
    tier.prefetch()
    assert [e.sid for e in tier._reading] == sorted(written, key=lambda s: s != read_first)
    for e in entries:
        if e.sid in written:
            tier.bring_to_host(e)
            assert e.host is not None
            tier.forget(e)
            pool.release(e.host)
    tier.close()


def test_the_plans_order_is_each_storages_last_copy_back() -> None:
    from hyperpar.offload.ir.packed_schedule import PackedSchedule, last_copy_in
    from hyperpar.offload.ir.schedule import ResidencyAction, ResidencySchedule
    from hyperpar.offload.ir.schedule import ResidencyActionType as Kind

    schedule = ResidencySchedule.empty(6)
    schedule.pre[1].append(ResidencyAction(Kind.COPY_D2H, 7))
    schedule.post[1].append(ResidencyAction(Kind.RELEASE_DEVICE, 7))
    schedule.pre[2].append(ResidencyAction(Kind.COPY_H2D, 7))  # paged in in forward ...
    schedule.post[2].append(ResidencyAction(Kind.COPY_H2D, 9))
    schedule.pre[5].append(ResidencyAction(Kind.COPY_H2D, 7))  # ... and back for backward: the last
    schedule.post[4].append(ResidencyAction(Kind.RELEASE_HOST, 9))
    assert last_copy_in(PackedSchedule(schedule)) == {7: 5, 9: 2}


@pytest.mark.parametrize(("must_go", "written"), [(None, [0, 2]), (frozenset({0}), [0]),
                                                   (frozenset(), [])])
def test_writes_ahead_of_need_take_only_the_copies_the_disk_plan_says_must_go(
        tmp_path: Path, must_go: frozenset[int] | None, written: list[int]) -> None:
    """The plan brings 0 back last, then 2. Past half the budget, writes ahead take the copy
    needed last among the ones the disk plan says must go (all without a disk plan); room that
    runs short after all still takes any."""
    tier, _ = _tier(tmp_path)
    tier.begin_step({0: 40, 1: 10, 2: 30, 3: 20}, must_go=must_go)
    entries = _evict_four(tier)
    assert [e.sid for e in entries if e.host is None] == written
    tier.make_room(4 * SLAB)  # the whole budget: any copy goes, the one needed last first
    assert all(e.host is None for e in entries)
    tier.close()


def test_a_small_copy_is_written_only_when_no_larger_one_can_be(tmp_path: Path) -> None:
    """Without a plan the copy evicted longest ago goes first, but not a small one (a direct
    transfer's fixed cost for little room) while a larger copy can go instead."""
    large = disk_tier.SMALL_BYTES
    pool = HostPool(4 * large, align=4096)
    tier = DiskTier(tmp_path, 4 * large, pool, finish=lambda event: None, is_done=lambda event: True,
                    drop_copy=lambda entry: None)
    tier.begin_step(None)
    entries = [_Entry(sid) for sid in range(4)]
    for e in entries:
        e.nbytes = SLAB if e.sid == 0 else large
        got = tier.acquire(e.nbytes)
        assert got is not None
        e.host = got[0]
        tier.evicted(e)
    assert [e.sid for e in entries if e.host is None] == [1, 2]  # not 0, the oldest
    tier.make_room(4 * large)  # the whole budget: the small one too, once no large one is left
    assert all(e.host is None for e in entries)
    tier.close()
