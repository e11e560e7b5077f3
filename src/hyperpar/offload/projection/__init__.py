"""GPU projection: predict a step's time on an accelerator from a trace recorded anywhere.

Until a GPU run exists, the per-op FLOPs and bytes of a trace, a device model (peak FLOP/s,
HBM and host-link bandwidth, launch latency) and a measured host cost per op give the step
time of plain PyTorch and of the session's replay at a budget, and which ops are launch-bound.
``FastArithmetic`` traces a step with its heavy arithmetic skipped (the ops, sizes and dtypes
stay those of the real step).
"""

from hyperpar.offload.projection.devices import DEVICES, DeviceModel, HostCosts, get_device
from hyperpar.offload.projection.fast_arithmetic import FastArithmetic
from hyperpar.offload.projection.op_costs import OpCost, op_costs
from hyperpar.offload.projection.timeline import Projection, device_op_ms, project

__all__ = [
    "DEVICES",
    "DeviceModel",
    "FastArithmetic",
    "HostCosts",
    "OpCost",
    "Projection",
    "device_op_ms",
    "get_device",
    "op_costs",
    "project",
]
