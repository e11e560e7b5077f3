"""Plan one trace at many budgets: the memory-vs-overhead curve of each planner."""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass

from hyperpar.offload.ir import ActivationTrace, ResidencySchedule
from hyperpar.offload.planning.arrays import TraceArrays, arrays_given, trace_arrays
from hyperpar.offload.planning.deficit_warnings import deficit_warnings_muted
from hyperpar.offload.planning.registry import get_planner
from hyperpar.offload.planning.simulate import SimResult, simulate
from hyperpar.offload.planning.tails import plan_with_tails


@dataclass(frozen=True)
class PlanPoint:
    planner: str
    budget_bytes: int
    budget_fraction: float  # of the peak without offload (the fraction asked for, in a sweep)
    predicted_peak_bytes: int
    deficit_bytes: int
    predicted_step_ms: float
    compute_ms: float
    overhead: float  # predicted step / compute - 1
    exposed_wait_ms: float
    bytes_d2h: int
    bytes_h2d: int
    plan_seconds: float  # wall clock
    plan_cpu_seconds: float  # this process's CPU time (robust on a shared machine)

    def as_dict(self) -> dict[str, float | int | str]:
        return asdict(self)


def with_budget(trace: ActivationTrace, budget_bytes: int) -> ActivationTrace:
    """A shallow copy of ``trace`` with another budget (ops and sizes are shared)."""
    out = copy.copy(trace)
    out.memory_limit_bytes = int(budget_bytes)
    return out


def plan_point(trace: ActivationTrace, planner: str, budget_fraction: float | None = None,
               ) -> tuple[PlanPoint, ResidencySchedule, SimResult]:
    """``budget_fraction``: the fraction of the peak the budget was made from, when it was
    (``int(peak * f) / peak`` is a little less than ``f``: a table must not round it away).
    Planned as a session plans it, tails included (``planning.tails``)."""
    peak = trace.peak_bytes_without_offload()
    started, cpu_started = time.perf_counter(), time.process_time()

    def plan_once(trace: ActivationTrace, arrays: TraceArrays) -> tuple[ResidencySchedule, SimResult]:
        with arrays_given(trace, arrays):
            schedule = get_planner(planner).build(trace)
            return schedule, simulate(trace, schedule)

    _, schedule, sim = plan_with_tails(trace, trace_arrays(trace), plan_once)
    seconds, cpu_seconds = time.perf_counter() - started, time.process_time() - cpu_started
    point = PlanPoint(
        planner=planner,
        budget_bytes=trace.memory_limit_bytes,
        budget_fraction=(budget_fraction if budget_fraction is not None
                         else trace.memory_limit_bytes / peak if peak else 1.0),
        predicted_peak_bytes=sim.peak_resident_bytes,
        deficit_bytes=schedule.deficit_bytes,
        predicted_step_ms=sim.predicted_step_ms,
        compute_ms=sim.compute_ms,
        overhead=sim.overhead,
        exposed_wait_ms=sim.exposed_wait_ms,
        bytes_d2h=sim.bytes_d2h,
        bytes_h2d=sim.bytes_h2d,
        plan_seconds=seconds,
        plan_cpu_seconds=cpu_seconds,
    )
    return point, schedule, sim


def sweep(
    trace: ActivationTrace,
    planners: Sequence[str],
    fractions: Iterable[float],
    progress: Callable[[Iterable], Iterable] = lambda it: it,
) -> list[PlanPoint]:
    """One point per (fraction, planner), in that order; each point's ``budget_fraction`` is
    the fraction asked for. Budgets below what the trace allows are part of a sweep: their
    deficit warnings are muted (the points carry the deficit)."""
    peak = trace.peak_bytes_without_offload()
    jobs = [(f, p) for f in fractions for p in planners]
    points = []
    with deficit_warnings_muted():
        for fraction, planner in progress(jobs):
            points.append(plan_point(with_budget(trace, int(peak * fraction)), planner, fraction)[0])
    return points
