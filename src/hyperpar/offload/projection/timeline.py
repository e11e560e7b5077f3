"""Two timelines, host and device, and the copy lanes: the projected step of each path.

The host launches op ``k`` when it has spent its cost on ops ``0..k`` (it runs ahead of the
device, never waiting for it); the device starts op ``k`` when op ``k-1`` has finished, the
launch has arrived (``launch_us`` after the host launched it) and, on the session's replay,
every storage the op accesses has arrived from the host and every storage it writes has left
(as ``simulate`` rules). A schedule's ``pre`` copies of op ``k`` are issued after op ``k-1`` (on
the host and on the device), its ``post`` copies after op ``k``; each copy lane (D2H, H2D) moves
one copy at a time at the link bandwidth. An op is launch-bound when its host cost exceeds its
device time: a device that waits for the host cannot catch up on it.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from hyperpar.offload.ir import ActivationTrace, ResidencySchedule
from hyperpar.offload.ir import ResidencyActionType as Act
from hyperpar.offload.ir.packed_schedule import KINDS, packed_actions
from hyperpar.offload.ir.trace import AccessKind, TraceOp
from hyperpar.offload.projection.devices import DeviceModel, HostCosts
from hyperpar.offload.projection.op_costs import TraceCosts, op_costs

if TYPE_CHECKING:
    from hyperpar.offload.planning.simulate import SimResult
    from hyperpar.offload.planning.sweep import PlanPoint

log = logging.getLogger(__name__)
_D2H, _H2D = KINDS.index(Act.COPY_D2H), KINDS.index(Act.COPY_H2D)


@dataclass
class PathTimes:
    """One path's projected step (µs): its end, the host's launch time, the device's busy time,
    its waits for copies, and its launch-bound ops (all ops, and those that run a kernel)."""

    step_us: float
    host_us: float
    device_busy_us: float
    copy_wait_us: float
    launch_bound_ops: int
    launch_bound_kernels: int
    op_start_us: list[float] = field(repr=False, default_factory=list)


@dataclass
class Projection:
    device: DeviceModel
    host: HostCosts
    costs: TraceCosts
    device_us: list[float]
    plain: PathTimes
    warmup: PathTimes  # the tracing step's host cost, without its copies
    replay: PathTimes
    budget_bytes: int
    peak_bytes: int  # the replay's predicted activation peak
    deficit_bytes: int
    bytes_d2h: int
    bytes_h2d: int

    @property
    def num_ops(self) -> int:
        return len(self.device_us)

    @property
    def kernels(self) -> int:
        return sum(1 for c in self.costs.ops if c.kernel)


def device_times_us(costs: TraceCosts, device: DeviceModel) -> list[float]:
    """Per op, the roofline time: FLOPs at peak or bytes at HBM bandwidth, whichever is longer."""
    flop_us, byte_us = 1e-6 / device.peak_tflops, 1e-3 / device.hbm_gbps
    return [max(c.flops * flop_us, c.bytes * byte_us) if c.kernel else 0.0 for c in costs.ops]


def device_op_ms(trace: ActivationTrace, device: DeviceModel, host_us: float) -> np.ndarray:
    """Per op, its time on ``device`` (ms): the longer of its roofline time and ``host_us``,
    the host's cost of launching it (the planner's op durations for a plan made for it)."""
    return np.maximum(np.asarray(device_times_us(op_costs(trace), device), dtype=np.float64), host_us) / 1e3


def run_timeline(device_us: list[float], host_us: float, launch_us: float,
                 trace: ActivationTrace | None = None, schedule: ResidencySchedule | None = None,
                 link_gbps: float = 0.0) -> tuple[PathTimes, int, int]:
    """One path's step; with a ``schedule`` (of ``trace``) its copies run on the lanes.
    Also returns the bytes copied each way."""
    n = len(device_us)
    pre: dict[int, list[tuple[int, int]]] = {}
    post: dict[int, list[tuple[int, int]]] = {}
    if schedule is not None:
        bounds, kinds, sids = packed_actions(schedule)
        for slot in range(2 * n):
            for j in range(bounds[slot], bounds[slot + 1]):
                if kinds[j] in (_D2H, _H2D):
                    (post if slot & 1 else pre).setdefault(slot >> 1, []).append((kinds[j], sids[j]))
    sizes = trace.storage_sizes if trace is not None else {}
    us_per_byte = 1e-3 / link_gbps if link_gbps > 0 else 0.0
    arrive: dict[int, float] = {}
    left: dict[int, float] = {}
    lane_free = {_D2H: 0.0, _H2D: 0.0}
    moved = {_D2H: 0, _H2D: 0}

    def issue(actions: list[tuple[int, int]], at: float) -> None:
        for kind, sid in actions:
            size = sizes.get(sid, 0)
            dep = arrive.get(sid, 0.0) if kind == _D2H else left.get(sid, 0.0)
            end = max(at, lane_free[kind], dep) + size * us_per_byte
            lane_free[kind] = end
            (left if kind == _D2H else arrive)[sid] = end
            moved[kind] += size

    device_end = waited = busy = 0.0
    starts: list[float] = []
    bound = bound_kernels = 0
    for k in range(n):
        launched = (k + 1) * host_us
        if k in pre:
            issue(pre[k], max(device_end, k * host_us))
        start = max(device_end, launched + launch_us)
        if trace is not None and (k in pre or arrive or left):
            ready = start
            for acc in trace.ops[k].accesses:
                ready = max(ready, arrive.get(acc.storage_id, 0.0))
                if acc.kind is AccessKind.WRITE:
                    ready = max(ready, left.get(acc.storage_id, 0.0))
            waited += ready - start
            start = ready
        starts.append(start)
        device_end = start + device_us[k]
        busy += device_us[k]
        if k in post:
            issue(post[k], max(device_end, launched))
        if host_us > device_us[k]:
            bound += 1
            bound_kernels += device_us[k] > 0
    step = max(device_end, n * host_us, *lane_free.values())
    return (PathTimes(step, n * host_us, busy, waited, bound, bound_kernels, starts),
            moved[_D2H], moved[_H2D])


def projected_trace(trace: ActivationTrace, device_us: list[float], host_us: float,
                    link_gbps: float, budget_bytes: int) -> ActivationTrace:
    """The trace as the planner would see it on the device: each op lasts the longer of its
    host cost and its device time, copies move at the link bandwidth."""
    out = copy.copy(trace)
    out.ops = [TraceOp(op.name, max(host_us, d) / 1e3, op.accesses) for op, d in zip(trace.ops, device_us,
                                                                                       strict=True)]
    out.d2h_bandwidth_gbps = out.h2d_bandwidth_gbps = link_gbps
    out.memory_limit_bytes = int(budget_bytes)
    return out


def device_plan(trace: ActivationTrace, device_us: list[float], device: DeviceModel, host: HostCosts,
                budget_bytes: int, planner: str = "timed") -> tuple[ActivationTrace, PlanPoint,
                                                                   ResidencySchedule, SimResult]:
    """The replay's plan on ``device`` at ``budget_bytes``: the trace as the planner sees it there
    (``projected_trace`` of the ops' device times ``device_us``), its plan point, schedule and
    simulation (the device's timeline, as the planner predicts it)."""
    from hyperpar.offload.planning.sweep import deficit_warnings_muted, plan_point

    planned = projected_trace(trace, device_us, host.replay_us, device.link_gbps, budget_bytes)
    with deficit_warnings_muted():
        point, schedule, sim = plan_point(planned, planner)
    return planned, point, schedule, sim


def project(trace: ActivationTrace, device: DeviceModel, host: HostCosts | None = None,
            budget_bytes: int | None = None, planner: str = "timed") -> Projection:
    """Plain, warmup and replay steps of ``trace`` on ``device``; the replay follows the schedule
    ``planner`` makes for the projected trace at ``budget_bytes`` (default: the trace's budget)."""
    host = host or HostCosts()
    costs = op_costs(trace)
    dev = device_times_us(costs, device)
    plain, _, _ = run_timeline(dev, host.plain_us, device.launch_us)
    warmup, _, _ = run_timeline(dev, host.warmup_us, device.launch_us)
    budget = trace.memory_limit_bytes if budget_bytes is None else budget_bytes
    if budget < 0:
        raise ValueError(f"budget_bytes must be >= 0, got {budget_bytes!r}")
    planned, point, schedule, _ = device_plan(trace, dev, device, host, budget, planner)
    replay, d2h, h2d = run_timeline(dev, host.replay_us, device.launch_us, planned, schedule,
                                    device.link_gbps)
    log.info("projected %d ops on %s: plain %.1f us, replay %.1f us", len(dev), device.name,
             plain.step_us, replay.step_us)
    return Projection(device, host, costs, dev, plain, warmup, replay, budget,
                      point.predicted_peak_bytes, point.deficit_bytes, d2h, h2d)
