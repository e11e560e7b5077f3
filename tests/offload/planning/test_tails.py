"""Tails: a storage Python holds past its last access and lets go of within the step. The
planners keep tails first; only where that plan runs over the budget are the tails alive
there taken off after their last access (copied out after their last write, never brought
back); the floor counts tails as movable."""

from __future__ import annotations

import pytest

from hyperpar.offload.ir import ActivationTrace, ResidencySchedule
from hyperpar.offload.planning import get_planner, min_feasible_budget, simulate, verify
from hyperpar.offload.planning.arrays import TraceArrays, arrays_given, trace_arrays
from hyperpar.offload.planning.floor import budget_floor
from hyperpar.offload.planning.simulate import SimResult
from hyperpar.offload.planning.tails import plan_with_tails
from tests.offload.planning.trace_builders import actions_text, make_trace

# sid 1: written at op 0, read at op 1, then only held by Python until op 4;
# sid 2 and 3 are the step's own working storages.
OPS = ["w1", "r1 w2", "r2 w3", "r3", "r3", "r3"]
SIZES = {1: 100, 2: 40, 3: 40}


def _trace(budget: int) -> ActivationTrace:
    trace = make_trace(OPS, SIZES, budget=budget)
    trace.death_ops = {1: 4}
    return trace


def _plan(trace: ActivationTrace, planner: str, calls: list[int] | None = None
          ) -> tuple[ActivationTrace, ResidencySchedule, SimResult]:
    def once(t: ActivationTrace, a: TraceArrays) -> tuple[ResidencySchedule, SimResult]:
        if calls is not None:
            calls.append(len(t.tail_sids))
        with arrays_given(t, a):
            schedule = get_planner(planner).build(t)
            return schedule, simulate(t, schedule)

    return plan_with_tails(trace, trace_arrays(trace), once)


@pytest.mark.parametrize("planner", ["greedy", "timed"])
def test_a_tail_leaves_after_its_last_access_only_where_the_budget_needs_it(planner: str) -> None:
    tight = _trace(budget=140)  # op 1's own 140; sid 1 kept makes op 2 hold 180
    calls: list[int] = []
    planned, schedule, sim = _plan(tight, planner, calls)
    assert calls == [1]  # no plan keeping sid 1 meets 140 at op 2: planned once, without it
    assert planned.tail_sids == {1}
    assert actions_text(schedule.post[0]) == ["d2h 1"]  # after its (only) write
    assert "free 1" in actions_text(schedule.post[1])  # after its last access
    assert not any("h2d 1" in actions_text(acts) for acts in schedule.pre)  # never back
    assert sim.peak_resident_bytes == 140
    verify(planned, schedule)
    loose = _trace(budget=200)  # fits as it is: the tail stays, nothing is copied
    planned, schedule, sim = _plan(loose, planner)
    assert planned.tail_sids == frozenset() and schedule.moved_sids() == frozenset()
    assert sim.peak_resident_bytes == 180


def test_the_floor_counts_tails_as_movable() -> None:
    trace = _trace(budget=90)
    assert min_feasible_budget(trace) == 180  # the bound on schedules that keep it: op 2
    floor = budget_floor(trace)
    assert floor.floor_bytes == 140 and floor.op == 1 and floor.peak_bytes == 180


def test_a_retained_storage_is_no_tail() -> None:
    trace = make_trace(OPS, SIZES, budget=140, retained=[1])
    planned, _, sim = _plan(trace, "greedy")
    assert planned.tail_sids == frozenset() and sim.peak_resident_bytes == 180
