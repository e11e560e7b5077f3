"""One copy each way of a few MiB, once per device: the planner's bandwidth figures."""

from __future__ import annotations

import time

import torch

PROBE_BYTES = 4 << 20
_cache: dict[str, tuple[float, float]] = {}


def _sync(device: torch.device) -> None:
    if device.type != "cpu" and torch.accelerator.is_available():
        torch.accelerator.synchronize()


def measure_bandwidth_gbps(device: torch.device) -> tuple[float, float]:
    """(device->host, host->device) in GB/s; cached, so later sessions pay nothing."""
    key = str(device)
    if key in _cache:
        return _cache[key]
    pin = device.type != "cpu"
    dev = torch.empty(PROBE_BYTES, dtype=torch.uint8, device=device)
    host = torch.empty(PROBE_BYTES, dtype=torch.uint8, pin_memory=pin)
    host.copy_(dev)  # first touch of both buffers, not timed
    _sync(device)
    t0 = time.perf_counter()
    host.copy_(dev)
    _sync(device)
    t1 = time.perf_counter()
    dev.copy_(host)
    _sync(device)
    t2 = time.perf_counter()
    result = (PROBE_BYTES / max(t1 - t0, 1e-9) / 1e9, PROBE_BYTES / max(t2 - t1, 1e-9) / 1e9)
    _cache[key] = result
    return result
