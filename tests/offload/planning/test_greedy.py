from __future__ import annotations

import pytest

from hyperpar.offload.planning import GreedyPlanner, Planner, get_planner
from tests.offload.planning.trace_builders import actions_text, make_trace


def plan(trace):
    return GreedyPlanner().build(trace)


def test_evicts_across_the_gap_and_frees_after_last_use() -> None:
    trace = make_trace(["w1", "w2", "r2 w3", "r1"], {1: 100, 2: 10, 3: 10}, budget=105)
    s = plan(trace)
    assert actions_text(s.post[0]) == ["d2h 1", "free 1"]
    assert actions_text(s.pre[3]) == ["h2d 1"]
    assert actions_text(s.post[2]) == ["free 2", "free 3"]
    assert actions_text(s.post[3]) == ["free 1", "freehost 1"]
    assert s.predicted_peak_bytes == 100 and s.deficit_bytes == 0 and s.deficit_op is None


def test_nothing_moves_when_the_trace_fits() -> None:
    trace = make_trace(["w1", "w2", "r2 w3", "r1"], {1: 100, 2: 10, 3: 10}, budget=120)
    s = plan(trace)
    assert s.moved_sids() == frozenset()
    assert all(a == [] for a in s.pre)


def test_longest_gap_first_then_stops_when_peak_fits() -> None:
    # sid 1 has the longest gap (0..5) but is small; sid 2 (1..4) is larger.
    ops = ["w1", "w2", "w3", "r3", "r2", "r1"]
    trace = make_trace(ops, {1: 10, 2: 50, 3: 5}, budget=60)
    # without offload ops 2..3 hold 65 > 60; evicting sid 1 alone fixes it.
    s = plan(trace)
    assert s.moved_sids() == frozenset({1})
    assert s.predicted_peak_bytes == 55


def test_larger_storage_wins_a_tie_in_length() -> None:
    ops = ["w1 w2", "w3", "r3", "r1 r2"]
    trace = make_trace(ops, {1: 10, 2: 50, 3: 5}, budget=60)
    s = plan(trace)
    assert s.moved_sids() == frozenset({2})


def test_gap_needs_an_over_budget_op_inside() -> None:
    # op 2 is over budget but it accesses sid 1: no gap of sid 1 can relieve it.
    ops = ["w1", "w2", "r1 r2 w3", "r2", "r1"]
    trace = make_trace(ops, {1: 40, 2: 40, 3: 40}, budget=100)
    s = plan(trace)
    assert s.moved_sids() == frozenset()
    assert s.deficit_bytes == 20 and s.deficit_op == 2


def test_d2h_starts_after_the_latest_write_before_the_gap() -> None:
    ops = ["w1", "w2", "r1", "w3", "w4", "r1"]
    trace = make_trace(ops, {1: 100, 2: 1, 3: 1, 4: 1}, budget=50)
    s = plan(trace)
    assert actions_text(s.post[0])[:1] == ["d2h 1"]
    assert "free 1" in actions_text(s.post[2])
    assert "d2h 1" not in actions_text(s.post[2])
    assert actions_text(s.pre[5]) == ["h2d 1"]


def test_write_after_the_first_copy_gets_a_fresh_copy() -> None:
    # sid 1: written at 0, written in place at 3, read at 6: both gaps evicted.
    ops = ["w1", "w2", "r2", "w1", "w3", "r3", "r1"]
    trace = make_trace(ops, {1: 100, 2: 1, 3: 1}, budget=10)
    s = plan(trace)
    assert actions_text(s.post[0]) == ["d2h 1", "free 1"]
    assert actions_text(s.pre[3]) == ["h2d 1"]
    assert actions_text(s.post[3]) == ["d2h 1", "free 1"]
    assert actions_text(s.pre[6]) == ["h2d 1"]


def test_read_only_second_gap_reuses_the_host_copy() -> None:
    ops = ["w1", "w2", "r2", "r1", "w3", "r3", "r1"]
    trace = make_trace(ops, {1: 100, 2: 1, 3: 1}, budget=10)
    s = plan(trace)
    d2h = [(i, a) for i, where, a in s.actions() if a.kind.value == "copy_d2h"]
    assert [i for i, _ in d2h] == [0]
    assert actions_text(s.post[3]) == ["free 1"]
    assert actions_text(s.pre[6]) == ["h2d 1"]


def test_retained_storage_stays_but_its_host_copy_is_freed() -> None:
    ops = ["w1", "w2", "r2", "r1"]
    trace = make_trace(ops, {1: 100, 2: 1}, budget=10, retained=[1])
    s = plan(trace)
    assert actions_text(s.post[3]) == ["freehost 1"]
    assert "free 1" in actions_text(s.post[0])


def test_infeasible_budget_reports_deficit() -> None:
    trace = make_trace(["w1", "r1 w2", "r2"], {1: 100, 2: 100}, budget=50)
    s = plan(trace)
    assert s.deficit_bytes == 150 and s.deficit_op == 1


def test_get_planner() -> None:
    assert get_planner("greedy").name == "greedy"
    assert get_planner("timed").name == "timed"
    assert isinstance(get_planner("greedy"), Planner)
    with pytest.raises(ValueError, match="'fancy'"):
        get_planner("fancy")
