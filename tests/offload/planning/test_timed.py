from __future__ import annotations

import pytest

from hyperpar.offload.planning import GreedyPlanner, TimedPlanner, simulate, verify
from hyperpar.offload.planning.bounds import (
    exposed_wait_lower_bound,
    min_resident_bytes,
    min_resident_bytes_timed,
)
from tests.offload.planning.trace_builders import actions_text, make_trace

MB = 1_000_000  # 1 ms per copy at 1 GB/s


def chain_trace(sizes: dict[int, int], budget: int, first: str = "w1", last: str = "r1"):
    # ops 1 ms each; sid 1 is produced at op 0 and read at op 5; small storages in between
    ops = [(first, 1.0), ("w2", 1.0), ("r2 w3", 1.0), ("r3 w4", 1.0), ("r4", 1.0), (last, 1.0)]
    return make_trace(ops, sizes, budget=budget, d2h_gbps=1.0, h2d_gbps=1.0)


def test_prefetch_finishes_before_its_consumer() -> None:
    trace = chain_trace({1: MB, 2: 10, 3: 10, 4: 10}, budget=MB + 15)
    timed = TimedPlanner().build(trace)
    verify(trace, timed)
    assert actions_text(timed.pre[4]) == ["h2d 1"]
    sim = simulate(trace, timed)
    assert sim.exposed_wait_ms == 0.0 and timed.deficit_bytes == 0
    greedy_sim = simulate(trace, GreedyPlanner().build(trace))
    assert greedy_sim.exposed_wait_ms == pytest.approx(1.0)


def test_in_flight_prefetch_counts_against_the_budget() -> None:
    # op 4 holds sid 4 (100 B): an H2D issued before op 4 would put it over budget
    trace = chain_trace({1: MB, 2: 10, 3: 10, 4: 100}, budget=MB + 15)
    timed = TimedPlanner().build(trace)
    verify(trace, timed)
    assert actions_text(timed.pre[5]) == ["h2d 1"]
    sim = simulate(trace, timed)
    assert sim.peak_resident_bytes <= trace.memory_limit_bytes and timed.deficit_bytes == 0
    assert sim.exposed_wait_ms == pytest.approx(1.0)


def test_prefers_the_eviction_whose_copies_fit_the_window() -> None:
    # sid 1 (10 MB) needs 10 ms each way, far more than the 5 ms window; sid 2 (1 MB) fits.
    trace = chain_trace({1: 10 * MB, 2: MB, 3: 10, 4: 10}, budget=11 * MB + 15, first="w1 w2", last="r1 r2")
    assert GreedyPlanner().build(trace).moved_sids() == frozenset({1})
    timed = TimedPlanner().build(trace)
    assert timed.moved_sids() == frozenset({2})
    assert simulate(trace, timed).exposed_wait_ms == 0.0 and timed.deficit_bytes == 0


def test_reports_the_deficit_when_the_budget_cannot_be_met() -> None:
    trace = chain_trace({1: MB, 2: 10, 3: 10, 4: 10}, budget=5)
    timed = TimedPlanner().build(trace)
    verify(trace, timed)
    sim = simulate(trace, timed)
    assert timed.deficit_bytes == sim.peak_resident_bytes - 5 > 0
    assert sim.resident_bytes[timed.deficit_op] == sim.peak_resident_bytes


def test_rejects_a_bad_round_count() -> None:
    with pytest.raises(ValueError, match=r"max_rounds.*0"):
        TimedPlanner(max_rounds=0)


def test_lower_bound_counts_the_storage_that_must_come_back_late() -> None:
    trace = chain_trace({1: MB, 2: 10, 3: 10, 4: 100}, budget=MB + 15)
    # op 4 must not hold sid 1, which op 5 reads right after: its whole 1 ms copy is exposed
    assert exposed_wait_lower_bound(trace) == pytest.approx(1.0)
    assert exposed_wait_lower_bound(chain_trace({1: MB, 2: 10, 3: 10, 4: 10}, budget=MB + 15)) == 0.0


def test_feasibility_floor_counts_copies_still_in_flight() -> None:
    # sid 1 is written by op 0 (1 ms) and its 1 ms D2H cannot end before op 1 starts
    trace = chain_trace({1: MB, 2: 10, 3: 10, 4: 10}, budget=0)
    assert min_resident_bytes(trace)[1] == 10
    assert min_resident_bytes_timed(trace)[1] == MB + 10
    assert min_resident_bytes_timed(trace)[2] == 20
