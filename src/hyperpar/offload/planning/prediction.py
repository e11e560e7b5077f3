"""Fill a schedule's predicted peak and deficit from the simulator, the same for every planner."""

from __future__ import annotations

import logging

from hyperpar.offload.ir import ActivationTrace, ResidencySchedule
from hyperpar.offload.planning.arrays import TraceArrays
from hyperpar.offload.planning.simulate import SimResult, simulate

logger = logging.getLogger(__name__)


def attach_prediction(
    trace: ActivationTrace, schedule: ResidencySchedule, arrays: TraceArrays | None = None,
    log: bool = True,
) -> SimResult:
    sim = simulate(trace, schedule, arrays)
    budget = trace.memory_limit_bytes
    schedule.budget_bytes = budget
    schedule.predicted_peak_bytes = sim.peak_resident_bytes
    if sim.peak_resident_bytes > budget:
        schedule.deficit_bytes = sim.peak_resident_bytes - budget
        schedule.deficit_op = sim.peak_op
        if log:
            logger.warning(
                "%s plan exceeds the budget of %d bytes by %d bytes at op %s",
                schedule.planner, budget, schedule.deficit_bytes, schedule.deficit_op,
            )
    else:
        schedule.deficit_bytes = 0
        schedule.deficit_op = None
    # Bytes over budget summed over ops: at a budget no plan can meet, the peak alone cannot
    # tell a plan that relieves every other op from one that relieves none.
    schedule.notes["over_budget_byte_ops"] = sum(r - budget for r in sim.resident_bytes if r > budget)
    schedule.notes["predicted_step_ms"] = sim.predicted_step_ms
    schedule.notes["exposed_wait_ms"] = sim.exposed_wait_ms
    return sim
