"""Activation offload: trace a step, plan what to move to host, replay the plan."""

from hyperpar.offload.api import OffloadConfig, OffloadSession, skip_offload
from hyperpar.offload.capture import OffloadCompileError, OffloadDivergenceError
from hyperpar.offload.ir.report import StepReport
from hyperpar.offload.runtime.recompute_regions import RecomputeMismatchError

__all__ = [
    "OffloadCompileError",
    "OffloadConfig",
    "OffloadDivergenceError",
    "OffloadSession",
    "RecomputeMismatchError",
    "StepReport",
    "skip_offload",
]
