"""Planners: turn an ActivationTrace into a ResidencySchedule."""

from hyperpar.offload.planning.base import Planner
from hyperpar.offload.planning.greedy import GreedyPlanner
from hyperpar.offload.planning.registry import PLANNER_NAMES, get_planner

__all__ = ["PLANNER_NAMES", "GreedyPlanner", "Planner", "get_planner"]
