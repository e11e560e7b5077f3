"""Capture: the dispatch mode and the executors that trace (warmup) and replay a step.

Five rooms, each importing only from those before it: ``ops`` (op facts), ``mode`` (the
dispatch mode, the online path), ``tracing`` (warmup), ``checked`` (the checked replay),
``fast`` (steps without the mode). What the api layer uses is re-exported here.
"""

from hyperpar.offload.capture.checked.replay import ReplayExecutor
from hyperpar.offload.capture.checked.replay_program import ReplayProgram, size_bucket
from hyperpar.offload.capture.mode import host_reads, native_callers
from hyperpar.offload.capture.mode.compiled import is_compiled, run_compiled
from hyperpar.offload.capture.mode.dispatch_mode import (
    OffloadDispatchMode,
    current_offload_mode,
    hold_step_hooks,
)
from hyperpar.offload.capture.mode.executor_base import ExecutorBase
from hyperpar.offload.capture.mode.host_reads import ActivationReadError
from hyperpar.offload.capture.mode.opaque import run_opaque
from hyperpar.offload.capture.ops.errors import OffloadCompileError, OffloadDivergenceError
from hyperpar.offload.capture.ops.op_args import tensor_inputs, written_tensors
from hyperpar.offload.capture.tracing.warmup import WarmupExecutor

__all__ = [
    "ActivationReadError",
    "ExecutorBase",
    "OffloadCompileError",
    "OffloadDispatchMode",
    "OffloadDivergenceError",
    "ReplayExecutor",
    "ReplayProgram",
    "WarmupExecutor",
    "current_offload_mode",
    "hold_step_hooks",
    "host_reads",
    "is_compiled",
    "native_callers",
    "run_compiled",
    "run_opaque",
    "size_bucket",
    "tensor_inputs",
    "written_tensors",
]
