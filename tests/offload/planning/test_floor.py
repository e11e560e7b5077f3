"""The feasible floor and its split: retained storages vs the op's working set."""

from __future__ import annotations

import pytest

from hyperpar.offload.ir import StepReport
from hyperpar.offload.planning import GreedyPlanner, min_feasible_budget
from hyperpar.offload.planning.floor import BudgetFloor, budget_floor
from tests.offload.planning.trace_builders import make_trace

# A (100 B) is kept after the step, last read at op 1; B (10 B) waits in a gap over ops 2-4
# (op 2 gives its copy time to land); C (1000 B) and D (1 B) are the working set of op 4.
SIZES = {0: 100, 1: 10, 2: 1000, 3: 1, 4: 1}
OPS = ["w0", "r0 w1", "w4", "w2", "r2 w3", "r1 r3"]


def _trace(budget: int):
    return make_trace(OPS, SIZES, budget, retained=[0], d2h_gbps=1e6, h2d_gbps=1e6)


def test_floor_is_the_bound_split_into_retained_and_working_set() -> None:
    floor = budget_floor(_trace(0))
    assert floor == BudgetFloor(floor_bytes=1101, op=4, op_name="op4", retained_bytes=100,
                                working_set_bytes=1001, peak_bytes=1111)
    assert floor.floor_bytes == min_feasible_budget(_trace(0))
    text = floor.describe()
    assert "at op 4 (op4)" in text and "kept after the step" in text


@pytest.mark.parametrize("budget, deficit", [(1101, 0), (1100, 1), (500, 601)])
def test_the_floor_is_exactly_what_a_plan_can_reach(budget: int, deficit: int) -> None:
    """B is all a plan can move: at the floor nothing is over, below it the plan is over by the gap."""
    schedule = GreedyPlanner().build(_trace(budget))
    assert schedule.deficit_bytes == deficit


def test_annotate_fills_the_report_and_its_line() -> None:
    report = StepReport("replay", 6, peak_resident_bytes=1101, budget_bytes=500)
    budget_floor(_trace(500)).annotate(report)
    assert (report.min_feasible_budget_bytes, report.unmovable_retained_bytes,
            report.unmovable_working_set_bytes) == (1101, 100, 1001)
    assert StepReport.from_dict(report.as_dict()) == report
    assert "floor 0.0 MiB (0.0 retained + 0.0 working set)" in str(report)


def test_below_floor_message_names_both_figures_in_mib() -> None:
    big = make_trace(["w0", "r0"], {0: 3 << 20}, 0, retained=[0])
    text = budget_floor(big).below_floor_message(1 << 20)
    assert "budget of 1.00 MiB is below the feasible floor of 3.00 MiB" in text
    assert "use at least 3.00 MiB" in text


def test_empty_trace_has_no_floor() -> None:
    floor = budget_floor(make_trace([], {}, 0))
    assert floor.floor_bytes == 0 and floor.op is None
