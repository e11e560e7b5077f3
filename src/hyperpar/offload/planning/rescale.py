"""Make a CPU-captured trace look like the same step on a GPU, for planner benchmarks.

A CPU runs these ops far slower than a GPU relative to how fast a PCIe link moves their
outputs, so planning on raw CPU timings would hide every copy. Durations are scaled by
one factor per trace, keeping their measured proportions, so that the step writes its
activation storages at ``write_gbps`` of compute time; the bandwidths are set to the
given link speeds.
"""

from __future__ import annotations

import copy

from hyperpar.offload.ir import ActivationTrace, TraceOp


def rescale_to_gpu(trace: ActivationTrace, write_gbps: float, d2h_gbps: float, h2d_gbps: float,
                   min_op_ms: float = 0.0) -> tuple[ActivationTrace, float]:
    """The rescaled copy and the factor applied to every duration."""
    for name, value in (("write_gbps", write_gbps), ("d2h_gbps", d2h_gbps), ("h2d_gbps", h2d_gbps)):
        if not value > 0:
            raise ValueError(f"{name} must be > 0, got {value!r}")
    total_ms = trace.total_duration_ms()
    written = sum(trace.storage_sizes.values())
    if total_ms <= 0 or written <= 0:
        raise ValueError("trace has no duration or no activation bytes to rescale")
    target_ms = written / (write_gbps * 1e6)
    factor = target_ms / total_ms
    out = copy.copy(trace)
    out.ops = [TraceOp(op.name, max(min_op_ms, op.duration_ms * factor), op.accesses) for op in trace.ops]
    out.d2h_bandwidth_gbps = d2h_gbps
    out.h2d_bandwidth_gbps = h2d_gbps
    return out, factor
