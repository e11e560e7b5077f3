"""Every planner on random traces: safe schedules, budgets met when feasible, honest deficits."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

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


@settings(max_examples=300, deadline=None)
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


@settings(max_examples=200, deadline=None)
@given(st.randoms(use_true_random=False))
def test_instant_copies_meet_every_feasible_budget(rng: random.Random) -> None:
    trace = random_trace(rng, timed=False)
    feasible = trace.memory_limit_bytes >= min_feasible_budget(trace)
    for name in PLANNERS:
        schedule = get_planner(name).build(trace)
        assert (schedule.deficit_bytes == 0) == feasible, name
