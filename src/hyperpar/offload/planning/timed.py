"""Placeholder until the duration- and bandwidth-aware planner lands."""

from __future__ import annotations

from hyperpar.offload.ir import ActivationTrace, ResidencySchedule
from hyperpar.offload.planning.greedy import GreedyPlanner


class TimedPlanner:
    name = "timed"

    def build(self, trace: ActivationTrace) -> ResidencySchedule:
        schedule = GreedyPlanner().build(trace)
        schedule.planner = self.name
        return schedule
