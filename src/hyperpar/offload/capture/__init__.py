"""Capture: the dispatch mode and the executors that trace (warmup) and replay a step."""

from hyperpar.offload.capture import host_reads, native_callers
from hyperpar.offload.capture.compiled import is_compiled, run_compiled
from hyperpar.offload.capture.dispatch_mode import OffloadDispatchMode, current_offload_mode, hold_step_hooks
from hyperpar.offload.capture.errors import OffloadCompileError, OffloadDivergenceError
from hyperpar.offload.capture.executor_base import ExecutorBase
from hyperpar.offload.capture.host_reads import ActivationReadError
from hyperpar.offload.capture.op_args import tensor_inputs, written_tensors
from hyperpar.offload.capture.opaque import run_opaque
from hyperpar.offload.capture.replay import ReplayExecutor
from hyperpar.offload.capture.replay_program import ReplayProgram, size_bucket
from hyperpar.offload.capture.warmup import WarmupExecutor

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
