"""A plan's disk plan (``planning.disk_plan``): the copies that must go to disk at a host budget,
Belady's rule at the points where room runs short, and the estimate of the tier that writes
ahead of need only those (``host_tier``'s default, the runtime's on a plan's steps)."""

from __future__ import annotations

import pytest

from hyperpar.offload.planning import simulate
from hyperpar.offload.planning.disk_plan import plan_disk
from hyperpar.offload.planning.host_tier import host_tier
from tests.offload.planning.test_host_tier import M, _four, _offload_all, zero_back_first
from tests.offload.planning.trace_builders import make_trace


def test_only_the_copies_the_budget_cannot_hold_must_go() -> None:
    """Four copies of M evicted in forward, read back in reverse; a budget of 2M: the copy outs
    of 2 and 3 find the budget full, and each writes the copy needed last (0, then 1). The
    online policy writes ahead past half the budget at every eviction: 0, 1 and 2."""
    trace, schedule = _four(), _offload_all(prefetch=False)
    plan = plan_disk(trace, schedule, 2 * M)
    assert plan.must_go == frozenset({0, 1}) and plan.bytes_to_disk == 2 * M
    planned = host_tier(trace, schedule, 2 * M)
    online = host_tier(trace, schedule, 2 * M, disk_plan=False)
    assert planned.spilled_sids == (0, 1) and online.spilled_sids == (0, 1, 2)
    assert (planned.bytes_to_disk, planned.bytes_from_disk) == (2 * M, 2 * M)
    assert planned.peak_host_bytes_budgeted <= 2 * M


def test_the_end_of_forward_writes_nothing_that_can_stay() -> None:
    """A budget of 3M: only the last copy out (3's) finds it full, so one copy must go (0, needed
    last); the online policy still wrote three, the one backward needs first (2) among them."""
    trace, schedule = _four(), _offload_all(prefetch=True)
    assert plan_disk(trace, schedule, 3 * M).must_go == frozenset({0})
    planned = host_tier(trace, schedule, 3 * M)
    assert planned.spilled_sids == (0,) and planned.bytes_from_disk == M
    assert host_tier(trace, schedule, 3 * M, disk_plan=False).spilled_sids == (0, 1, 2)


def test_fewer_writes_mean_fewer_waits_on_a_slow_disk() -> None:
    """1 GB/s both ways (M bytes in 1 ms), 1 ms ops: the online policy reads 2, 1, 0 on demand
    (3 ms of waits); with the plan 0 and 1 are on disk and 1 is read on demand at its copy
    back, 0 after it: 2 ms."""
    trace, schedule = _four(ms=1.0), _offload_all(prefetch=False)
    sim = simulate(trace, schedule)
    planned = host_tier(trace, schedule, 2 * M, 1.0, 1.0, timeline=sim)
    online = host_tier(trace, schedule, 2 * M, 1.0, 1.0, timeline=sim, disk_plan=False)
    assert online.disk_wait_ms == pytest.approx(3.0)
    assert planned.disk_wait_ms == pytest.approx(2.0) and planned.demand_reads == 2


def test_the_copy_backward_needs_first_stays_on_host() -> None:
    """0 is read first in backward though it left first: the copies that must go are the ones
    brought back last (2 and 1 at a budget of 2M), never 0."""
    plan = plan_disk(*zero_back_first(), 2 * M)
    assert plan.must_go == frozenset({1, 2})


@pytest.mark.parametrize(("budget", "expected"), [(4 * M, frozenset()), (8 * M, frozenset()),
                                                   (M // 2, frozenset())])
def test_budgets_that_hold_every_copy_or_none(budget: int, expected: frozenset[int]) -> None:
    """At the host peak or above nothing must go; below one copy nothing can be held, so
    nothing is written either (those copies stay on the device)."""
    plan = plan_disk(_four(), _offload_all(prefetch=False), budget)
    assert plan.must_go == expected and plan.bytes_to_disk == 0


def test_sizes_are_counted_as_the_pool_carves_them() -> None:
    """Copies of M bytes in slabs of 2**20 (the pool's alignment): the plan's bytes are slabs'."""
    plan = plan_disk(_four(), _offload_all(prefetch=False), 2 * (1 << 20), align=1 << 20)
    assert plan.bytes_to_disk == 2 * (1 << 20)


@pytest.mark.parametrize(("budget", "align", "match"), [(-1, 1, "host_budget_bytes must be >= 0, got -1"),
                                                         (M, 0, "align must be >= 1, got 0")])
def test_bad_arguments(budget: int, align: int, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        plan_disk(_four(), _offload_all(prefetch=False), budget, align)


def test_a_small_copy_goes_to_disk_only_when_no_larger_one_can() -> None:
    """Storage 0 is needed last but is 64 KiB: writing it first would free little room for a
    direct write's fixed cost, and 1 (1 MB, needed next to last) would have to go anyway."""
    small = 64 << 10
    ops = [(f"w{i}", 1.0) for i in range(4)] + [(f"r{3 - k}", 1.0) for k in range(4)]
    trace = make_trace(ops, {0: small, 1: M, 2: M, 3: M}, budget=M)
    plan = plan_disk(trace, _offload_all(prefetch=False), 2 * M + small)
    assert plan.must_go == frozenset({1}) and plan.bytes_to_disk == M
