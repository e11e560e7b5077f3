"""The offload IR: what warmup recorded (trace) and what replay will do (schedule)."""

from hyperpar.offload.ir.guide import LeafMeta, OpGuide
from hyperpar.offload.ir.json_io import IRFormatError
from hyperpar.offload.ir.report import StepReport
from hyperpar.offload.ir.schedule import ResidencyAction, ResidencyActionType, ResidencySchedule
from hyperpar.offload.ir.trace import AccessKind, ActivationTrace, StorageAccess, TraceOp

__all__ = [
    "AccessKind",
    "ActivationTrace",
    "IRFormatError",
    "LeafMeta",
    "OpGuide",
    "ResidencyAction",
    "ResidencyActionType",
    "ResidencySchedule",
    "StepReport",
    "StorageAccess",
    "TraceOp",
]
