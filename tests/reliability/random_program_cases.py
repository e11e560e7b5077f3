"""Hypothesis searches over programs with issue 11's ``DATA_KINDS`` (data-dependent aliasing,
sparse COO from activations, reads behind the dispatcher), with fixed and with changing batch
sizes. They run in a child interpreter (tests/reliability/test_random_programs.py): on main
these programs can crash it. Derandomized, no database: the same cases on every run."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from tests.reliability.program_check import BUDGETS, check_program
from tests.reliability.random_programs import Instr, data_programs
from tests.subprocess_harness import report_cases

FIXED_EXAMPLES = 80
CHANGING_EXAMPLES = 40


@settings(max_examples=FIXED_EXAMPLES, deadline=None, derandomize=True, database=None)
@given(program=data_programs, budget=BUDGETS, planner=st.sampled_from(["greedy", "timed"]))
def fuzz_fixed_batches(program: list[Instr], budget: int, planner: str) -> None:
    check_program(program, budget, planner)


@settings(max_examples=CHANGING_EXAMPLES, deadline=None, derandomize=True, database=None)
@given(program=data_programs, budget=BUDGETS,
       batches=st.lists(st.sampled_from([2, 4, 5]), min_size=3, max_size=5))
def fuzz_changing_batches(program: list[Instr], budget: int, batches: list[int]) -> None:
    check_program(program, budget, "greedy", tuple(batches))


def cases() -> None:
    report_cases({"fixed batches": fuzz_fixed_batches, "changing batches": fuzz_changing_batches})
