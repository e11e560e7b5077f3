"""Fill a schedule's predicted peak and deficit from the simulator, the same for every planner."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from hyperpar.offload.ir import ActivationTrace, ResidencySchedule
from hyperpar.offload.ir.packed_schedule import action_count
from hyperpar.offload.planning.arrays import TraceArrays
from hyperpar.offload.planning.simulate import SimResult, simulate

logger = logging.getLogger(__name__)
_kept = threading.local()  # .box: the simulations recorded by ``simulations_kept``, or None


@contextmanager
def simulations_kept() -> Iterator[dict[int, tuple[ResidencySchedule, int, SimResult]]]:
    """Record every ``attach_prediction`` of this thread meanwhile, so the caller can take the
    simulation of the schedule a planner returned instead of running it again."""
    saved = getattr(_kept, "box", None)
    _kept.box = box = {}
    try:
        yield box
    finally:
        _kept.box = saved


def kept_simulation(box: dict[int, tuple[ResidencySchedule, int, SimResult]],
                    schedule: ResidencySchedule) -> SimResult | None:
    """The recorded simulation of this very schedule, unless its actions changed since."""
    entry = box.get(id(schedule))
    if entry is None or entry[0] is not schedule or entry[1] != action_count(schedule):
        return None
    return entry[2]


def say_deficit(schedule: ResidencySchedule) -> None:
    """Warn that ``schedule`` runs over its budget (``deficit_bytes`` at ``deficit_op``)."""
    logger.warning("%s plan exceeds the budget of %d bytes by %d bytes at op %s",
                   schedule.planner, schedule.budget_bytes, schedule.deficit_bytes, schedule.deficit_op)


def attach_prediction(
    trace: ActivationTrace, schedule: ResidencySchedule, arrays: TraceArrays | None = None,
    log: bool = True,
) -> SimResult:
    sim = simulate(trace, schedule, arrays)
    box = getattr(_kept, "box", None)
    if box is not None:
        box[id(schedule)] = (schedule, action_count(schedule), sim)
    budget = trace.memory_limit_bytes
    schedule.budget_bytes = budget
    schedule.predicted_peak_bytes = sim.peak_resident_bytes
    if sim.peak_resident_bytes > budget:
        schedule.deficit_bytes = sim.peak_resident_bytes - budget
        schedule.deficit_op = sim.peak_op
        if log:
            say_deficit(schedule)
    else:
        schedule.deficit_bytes = 0
        schedule.deficit_op = None
    # Bytes over budget summed over ops: at a budget no plan can meet, the peak alone cannot
    # tell a plan that relieves every other op from one that relieves none.
    schedule.notes["over_budget_byte_ops"] = sum(r - budget for r in sim.resident_bytes if r > budget)
    schedule.notes["predicted_step_ms"] = sim.predicted_step_ms
    schedule.notes["exposed_wait_ms"] = sim.exposed_wait_ms
    return sim
