"""Device models and host costs per op: the numbers a projection is made of, named and checked.

The device figures are datasheet values (dense, no sparsity); the host costs are what this
project measured on a CPU (``benchmarks/replay_overhead.py``, ``benchmarks/tiny_ops.py``),
defaults until a GPU run measures them (``benchmarks/gpu/run.py`` records them).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


def _check(name: str, value: float, positive: bool) -> None:
    ok = math.isfinite(value) and (value > 0 if positive else value >= 0)
    if not ok:
        raise ValueError(f"{name} must be finite and {'> 0' if positive else '>= 0'}, got {value!r}")


@dataclass(frozen=True)
class DeviceModel:
    """One accelerator: dense peak (FLOP/s in the trace's dtype), HBM and host-link bandwidths
    (GB/s, each link direction on its own) and the latency from a launch to the kernel starting."""

    name: str
    peak_tflops: float
    hbm_gbps: float
    link_gbps: float
    launch_us: float

    def __post_init__(self) -> None:
        for field_name in ("peak_tflops", "hbm_gbps", "link_gbps"):
            _check(field_name, getattr(self, field_name), positive=True)
        _check("launch_us", self.launch_us, positive=False)


@dataclass(frozen=True)
class HostCosts:
    """Host µs per op on each path: plain PyTorch, the session's replay and its warmup (trace).

    Defaults are CPU-measured; pass the ones a GPU run measured when there are some. Replay
    and warmup are plain's times the ratios ``benchmarks/host_cost.py`` measures on HF Llama
    at 50 % of its peak (2026-12-06, 3f06f0d: the fast path's 1.47x, where the dispatch-mode
    replay it replaced was 3.50x, ``host_cost_996f7f8.json``; warmup 4.46x, 4.23x since)."""

    plain_us: float = 6.0
    replay_us: float = 8.8
    warmup_us: float = 27.0

    def __post_init__(self) -> None:
        for field_name in ("plain_us", "replay_us", "warmup_us"):
            _check(field_name, getattr(self, field_name), positive=False)


DEVICES: dict[str, DeviceModel] = {
    "h100": DeviceModel("h100", peak_tflops=989.0, hbm_gbps=3350.0, link_gbps=50.0, launch_us=4.0),
    "h200": DeviceModel("h200", peak_tflops=989.0, hbm_gbps=4800.0, link_gbps=50.0, launch_us=4.0),
    "a100": DeviceModel("a100", peak_tflops=312.0, hbm_gbps=2039.0, link_gbps=25.0, launch_us=4.0),
}


def get_device(name: str) -> DeviceModel:
    """The model named ``name`` (case-insensitive)."""
    try:
        return DEVICES[name.lower()]
    except KeyError:
        raise ValueError(f"device must be one of {sorted(DEVICES)}, got {name!r}") from None
