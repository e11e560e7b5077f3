"""The reference system's greedy planner, minus its stale-copy bug.

It reasons in bytes only: a chosen gap frees its storage for every op strictly inside
it. Copies are issued at the last moment (H2D right before the consumer), so it ignores
op durations and bandwidth; ``TimedPlanner`` is the one that does not.
"""

from __future__ import annotations

import logging

from hyperpar.offload.ir import ActivationTrace, ResidencySchedule
from hyperpar.offload.planning.byte_model import resident_after_evictions
from hyperpar.offload.planning.emit import emit_schedule
from hyperpar.offload.planning.greedy_reference import select_gaps_reference

logger = logging.getLogger(__name__)


class GreedyPlanner:
    name = "greedy"

    def build(self, trace: ActivationTrace) -> ResidencySchedule:
        chosen = select_gaps_reference(trace)
        schedule = emit_schedule(trace, chosen, self.name)
        resident = resident_after_evictions(trace, chosen)
        peak = max(resident, default=0)
        schedule.predicted_peak_bytes = peak
        if peak > trace.memory_limit_bytes:
            schedule.deficit_bytes = peak - trace.memory_limit_bytes
            schedule.deficit_op = resident.index(peak)
            logger.warning(
                "greedy plan exceeds the budget of %d bytes by %d bytes at op %d",
                trace.memory_limit_bytes, schedule.deficit_bytes, schedule.deficit_op,
            )
        schedule.notes["evicted_gaps"] = len(chosen)
        return schedule
