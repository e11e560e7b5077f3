"""Planners: turn an ActivationTrace into a ResidencySchedule, then check and time it."""

from hyperpar.offload.planning.base import Planner
from hyperpar.offload.planning.bounds import min_feasible_budget, min_resident_bytes
from hyperpar.offload.planning.floor import BudgetFloor, budget_floor
from hyperpar.offload.planning.greedy import GreedyPlanner
from hyperpar.offload.planning.registry import PLANNER_NAMES, get_planner
from hyperpar.offload.planning.simulate import SimResult, simulate
from hyperpar.offload.planning.timed import TimedPlanner
from hyperpar.offload.planning.verify import ScheduleError, verify

__all__ = [
    "PLANNER_NAMES",
    "BudgetFloor",
    "GreedyPlanner",
    "Planner",
    "ScheduleError",
    "SimResult",
    "TimedPlanner",
    "budget_floor",
    "get_planner",
    "min_feasible_budget",
    "min_resident_bytes",
    "simulate",
    "verify",
]
