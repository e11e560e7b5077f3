"""Host-link bandwidth as the copy engine sees it: the planner's and simulator's figures.

Several sizes, each direction alone and both at once, after a warm-up, the median of a few
repeats; the largest size gives the headline figure (the per-size figures show latency).
Measured through the engine replay uses (copy streams on an accelerator, the worker threads
on CPU) and cached per device and engine, so later sessions pay nothing.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from hyperpar.offload.runtime.copy_engine import CopyEngine
from hyperpar.offload.runtime.engine_factory import make_copy_engine
from hyperpar.offload.runtime.normal_tensors import made_outside_inference_mode

CPU_SIZES = (256 << 10, 1 << 20, 4 << 20)
ACCELERATOR_SIZES = (1 << 20, 16 << 20, 64 << 20)
REPEATS = 5
_cache: dict[tuple[torch.device, str], LinkBandwidth] = {}


@dataclass(frozen=True)
class LinkBandwidth:
    d2h_gbps: float
    h2d_gbps: float
    duplex_d2h_gbps: float  # each direction while the other runs too
    duplex_h2d_gbps: float
    engine: str
    per_size: dict[int, tuple[float, float]] = field(default_factory=dict)  # bytes -> (d2h, h2d) GB/s

    def as_dict(self) -> dict[str, Any]:
        return {"d2h_gbps": self.d2h_gbps, "h2d_gbps": self.h2d_gbps,
                "duplex_d2h_gbps": self.duplex_d2h_gbps, "duplex_h2d_gbps": self.duplex_h2d_gbps,
                "engine": self.engine, "per_size": {str(k): v for k, v in self.per_size.items()}}


def _timed(engine: CopyEngine, issue: list[tuple[str, torch.Tensor, torch.Tensor]]) -> float:
    t0 = time.perf_counter()
    events = [engine.copy_d2h(dst, src) if lane == "d2h" else engine.copy_h2d(dst, src)
              for lane, dst, src in issue]
    for ev in events:
        if ev is not None:
            ev.synchronize()
    engine.poll()
    return max(time.perf_counter() - t0, 1e-9)


def _gbps(nbytes: int, seconds: list[float]) -> float:
    return nbytes / statistics.median(seconds) / 1e9


@made_outside_inference_mode
def probe_link(device: torch.device, engine: CopyEngine | None = None) -> LinkBandwidth:
    own = engine is None
    if engine is None:
        engine = make_copy_engine(device)
    key = (device, engine.name)
    if key in _cache:
        return _cache[key]
    sizes = CPU_SIZES if device.type == "cpu" else ACCELERATOR_SIZES
    pin = device.type != "cpu"
    big = sizes[-1]
    dev_a = torch.empty(big, dtype=torch.uint8, device=device)
    dev_b = torch.empty(big, dtype=torch.uint8, device=device)
    host_a = torch.empty(big, dtype=torch.uint8, pin_memory=pin)
    host_b = torch.empty(big, dtype=torch.uint8, pin_memory=pin)
    per_size: dict[int, tuple[float, float]] = {}
    try:
        for n in sizes:
            d2h = [("d2h", host_a[:n], dev_a[:n])]
            h2d = [("h2d", dev_b[:n], host_b[:n])]
            _timed(engine, d2h + h2d)  # warm-up: first touch, stream and thread start
            per_size[n] = (_gbps(n, [_timed(engine, d2h) for _ in range(REPEATS)]),
                           _gbps(n, [_timed(engine, h2d) for _ in range(REPEATS)]))
        duplex = _gbps(big, [_timed(engine, [("d2h", host_a, dev_a), ("h2d", dev_b, host_b)])
                             for _ in range(REPEATS)])
    finally:
        if own:
            engine.close()
    result = LinkBandwidth(d2h_gbps=per_size[big][0], h2d_gbps=per_size[big][1], duplex_d2h_gbps=duplex,
                           duplex_h2d_gbps=duplex, engine=engine.name, per_size=per_size)
    _cache[key] = result
    return result


def measure_bandwidth_gbps(device: torch.device, engine: CopyEngine | None = None) -> tuple[float, float]:
    """(device->host, host->device) in GB/s, as ``probe_link`` measures them (cached)."""
    link = probe_link(device, engine)
    return link.d2h_gbps, link.h2d_gbps
