"""A saved trace's step on a device model with each lever: offload only, full checkpointing
per layer, and the mixed plan (some layers rebuilt, the rest offloaded), at one budget.

The layers come from the trace itself (``planning.levers.layer_blocks``); a rebuilt layer's
step is the trace it would record (``planning.levers.rebuilt_trace``), planned and projected
like any other. The mixed plan is the fastest of "the first k layers rebuilt, the rest
planned to host" over every k (the first layers' activations live longest), preferring one
that meets the budget; the session's own choice also rebuilds parts of layers (norms, MLPs).
The budget is a share of the movable activation peak plus the kept bytes, as
``OffloadConfig.max_resident_fraction`` makes it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any

from hyperpar.offload.ir import ActivationTrace
from hyperpar.offload.planning.arrays import kept_and_movable_peak, trace_arrays
from hyperpar.offload.planning.floor import budget_floor
from hyperpar.offload.planning.levers.layer_blocks import forward_end_of, repeated_blocks
from hyperpar.offload.planning.levers.rebuilt_trace import rebuilt_bytes, rebuilt_trace
from hyperpar.offload.projection.devices import DeviceModel, HostCosts
from hyperpar.offload.projection.timeline import Projection, project


@dataclass(frozen=True)
class LeverSteps:
    """Projected steps (ms) and bytes of each lever at one budget."""

    device: str
    plain_ms: float
    offload_only_ms: float
    full_ac_ms: float | None  # None: no repeated layers in the trace
    step_ms: float  # the mixed plan's
    peak_bytes: int  # the movable activation peak without offload
    kept_bytes: int
    budget_bytes: int
    offload_bytes: int  # the mixed plan's copies to host
    recompute_bytes: int  # what its rebuilt layers do not keep
    rebuilt_layers: int
    layers: int
    layer_ops: int
    forward_end_op: int
    floor_bytes: int  # the mixed plan's floor
    meets_budget: bool
    offload_only_floor_bytes: int = 0  # the floor without rebuilding, beside the mixed plan's

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def project_at_budget(trace: ActivationTrace, device: DeviceModel, host: HostCosts, budget_bytes: int,
                      planner: str = "timed") -> tuple[Projection, int]:
    """``trace`` projected at ``budget_bytes``, planned for its floor where that is higher (as a
    session plans a budget below the floor), and that floor."""
    floor = floor_at(trace, budget_bytes)
    return project(replace(trace, memory_limit_bytes=budget_bytes), device, host, max(budget_bytes, floor),
                   planner), floor


def floor_at(trace: ActivationTrace, budget_bytes: int) -> int:
    """``trace``'s floor with ``budget_bytes`` as its budget (a plan below it is made for it)."""
    return budget_floor(replace(trace, memory_limit_bytes=budget_bytes)).floor_bytes


def lever_steps(trace: ActivationTrace, device: DeviceModel, host: HostCosts, fraction: float,
                planner: str = "timed") -> LeverSteps:
    """Each lever's projected step for ``trace`` on ``device`` at ``fraction`` of its movable peak."""
    if not 0 < fraction <= 1:
        raise ValueError(f"fraction must be in (0, 1], got {fraction!r}")
    trace = replace(trace, reserve_retained=True)
    kept, movable_peak = kept_and_movable_peak(trace_arrays(trace), trace.retained_sids)
    budget = int(fraction * movable_peak) + kept
    forward_end = forward_end_of(trace)
    blocks = repeated_blocks(trace, forward_end)

    def step(t: ActivationTrace) -> tuple[float, int, int, bool]:
        proj, floor = project_at_budget(t, device, host, budget, planner)
        return proj.replay.step_us / 1e3, proj.bytes_d2h, floor, floor <= budget

    plain = project(trace, device, host, trace.peak_bytes_without_offload() + kept, planner)
    offload_only = step(trace)
    full_ac = None
    if blocks:
        ac = rebuilt_trace(trace, blocks, forward_end)
        full_ac = project(ac, device, host, ac.peak_bytes_without_offload() + kept, planner).plain.step_us
        full_ac /= 1e3
    best = (not offload_only[3], offload_only[0], 0, offload_only)
    for k in range(1, len(blocks) + 1):
        got = step(rebuilt_trace(trace, blocks[:k], forward_end))
        best = min(best, (not got[3], got[0], k, got))
    _, step_ms, k, (_, d2h, floor, meets) = best
    freed = rebuilt_bytes(trace, blocks[:k], forward_end)
    return LeverSteps(device.name, plain.plain.step_us / 1e3, offload_only[0], full_ac, step_ms, movable_peak,
                      kept, budget, d2h, freed, k, len(blocks), blocks[0][1] - blocks[0][0] if blocks else 0,
                      forward_end, floor, meets, offload_only[2])

