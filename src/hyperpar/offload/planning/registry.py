"""Planners by name, for ``OffloadConfig(planner="...")`` and the command line."""

from __future__ import annotations

from hyperpar.offload.planning.base import Planner

PLANNER_NAMES = ("greedy", "timed")


def get_planner(name: str) -> Planner:
    if name == "greedy":
        from hyperpar.offload.planning.greedy import GreedyPlanner

        return GreedyPlanner()
    if name == "timed":
        from hyperpar.offload.planning.timed import TimedPlanner

        return TimedPlanner()
    raise ValueError(f"planner must be one of {', '.join(PLANNER_NAMES)}; got {name!r}")
