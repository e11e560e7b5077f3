"""Every planner on random traces: safe schedules, budgets met when feasible, honest deficits."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from hyperpar.offload.ir import AccessKind, ActivationTrace, StorageAccess, TraceOp
from hyperpar.offload.planning import get_planner
from hyperpar.offload.planning.bounds import (
    exposed_wait_lower_bound,
    min_feasible_budget,
    min_resident_bytes,
    min_resident_bytes_timed,
)
from hyperpar.offload.planning.simulate import simulate
from hyperpar.offload.planning.verify import verify
from tests.offload.planning.random_traces import random_trace

PLANNERS = ("greedy", "timed")


@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(st.randoms(use_true_random=False))
def test_every_planner_is_safe_and_honest(rng: random.Random) -> None:
    trace = random_trace(rng)
    floor = min_resident_bytes(trace)
    timed_floor = min_resident_bytes_timed(trace)
    lower_bound = exposed_wait_lower_bound(trace)
    for name in PLANNERS:
        schedule = get_planner(name).build(trace)
        verify(trace, schedule)
        sim = simulate(trace, schedule)
        assert all(r >= f for r, f in zip(sim.resident_bytes, floor, strict=True))
        if sim.exposed_wait_ms == 0.0:  # the timed floor holds on the wait-free timeline
            assert all(r >= f for r, f in zip(sim.resident_bytes, timed_floor, strict=True))
        assert schedule.predicted_peak_bytes == sim.peak_resident_bytes
        over = sim.peak_resident_bytes - trace.memory_limit_bytes
        assert schedule.deficit_bytes == max(0, over)
        assert (schedule.deficit_op is not None) == (over > 0)
        if over > 0:
            assert sim.resident_bytes[schedule.deficit_op] == sim.peak_resident_bytes
        else:  # a schedule within budget waits at least the lower bound
            assert sim.exposed_wait_ms >= lower_bound - 1e-9


@settings(max_examples=200, deadline=None, derandomize=True, database=None)
@given(st.randoms(use_true_random=False))
def test_instant_copies_meet_every_feasible_budget(rng: random.Random) -> None:
    trace = random_trace(rng, timed=False)
    feasible = trace.memory_limit_bytes >= min_feasible_budget(trace)
    for name in PLANNERS:
        schedule = get_planner(name).build(trace)
        assert (schedule.deficit_bytes == 0) == feasible, name


def _zero_duration_trace() -> ActivationTrace:
    """A trace the search above found (rebuilt from its saved example): zero-duration
    ops around a 64-byte storage, copies comparable to ops, 16 of 17 storages retained. A
    100-byte copy ends exactly where op 15 starts; the bound turned that time back into
    99.99999999999964 bytes and truncated it, one byte above the simulated schedule."""
    W = AccessKind.WRITE
    writes: list[tuple[int, ...]] = [
        (0,), (0, 1, 2), (0,), (0, 3), (0, 4), (0, 5), (0, 6), (0,), (0, 7), (0,), (0,), (0,), (0,),
        (5, 8), (0,), (0, 9, 10), (0,), (0, 11), (0,), (0, 12), (0, 13), (5, 14), (0, 15, 16), (0,)]
    durations = [0.0] * 11 + [3.0, 1.0, 0.0, 0.1, 0.0, 0.0, 0.5] + [0.0] * 6
    ops = [TraceOp(f"op{i}", d, tuple(StorageAccess(i, s, W) for s in sids))
           for i, (sids, d) in enumerate(zip(writes, durations, strict=True))]
    sizes = {sid: 1 for sid in range(17)} | {5: 100, 9: 64}
    return ActivationTrace(ops, sizes, frozenset(range(17)) - {9}, 121, 0.001, 0.0005)


def test_timed_floor_holds_on_a_trace_of_zero_duration_ops() -> None:
    trace = _zero_duration_trace()
    sim = simulate(trace, get_planner("timed").build(trace))
    assert sim.exposed_wait_ms == 0.0
    floor = min_resident_bytes_timed(trace)
    assert all(r >= f for r, f in zip(sim.resident_bytes, floor, strict=True))
