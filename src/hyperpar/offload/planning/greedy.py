"""The reference system's greedy planner, minus its stale-copy bug.

It reasons in bytes only: a chosen gap frees its storage for every op strictly inside
it. Copies are issued at the last moment (H2D right before the consumer), so it ignores
op durations and bandwidth; ``TimedPlanner`` is the one that does not.
"""

from __future__ import annotations

from hyperpar.offload.ir import ActivationTrace, ResidencySchedule
from hyperpar.offload.planning.byte_model import resident_after_evictions
from hyperpar.offload.planning.emit import emit_schedule
from hyperpar.offload.planning.greedy_reference import select_gaps_reference
from hyperpar.offload.planning.prediction import attach_prediction


class GreedyPlanner:
    name = "greedy"

    def build(self, trace: ActivationTrace) -> ResidencySchedule:
        chosen = select_gaps_reference(trace)
        schedule = emit_schedule(trace, chosen, self.name)
        schedule.notes["evicted_gaps"] = len(chosen)
        schedule.notes["byte_model_peak_bytes"] = max(resident_after_evictions(trace, chosen), default=0)
        attach_prediction(trace, schedule)
        return schedule
