"""The bandwidth probe: several sizes, both directions and duplex, fast on CPU, cached."""

from __future__ import annotations

import time

import torch

from hyperpar.offload.runtime import ThreadCopyEngine, measure_bandwidth_gbps, probe_link
from hyperpar.offload.runtime import bandwidth as bandwidth_module


def test_probe_measures_the_thread_engine_quickly_and_caches() -> None:
    bandwidth_module._cache.clear()
    engine = ThreadCopyEngine()
    t0 = time.perf_counter()
    link = probe_link(torch.device("cpu"), engine)
    elapsed = time.perf_counter() - t0
    assert elapsed < 0.5, elapsed
    assert link.engine == "thread"
    assert link.d2h_gbps > 0 and link.h2d_gbps > 0 and link.duplex_d2h_gbps > 0
    assert sorted(link.per_size) == list(bandwidth_module.CPU_SIZES)
    assert link.d2h_gbps == link.per_size[max(link.per_size)][0]
    t0 = time.perf_counter()
    assert probe_link(torch.device("cpu"), engine) is link
    assert time.perf_counter() - t0 < 0.01
    assert measure_bandwidth_gbps(torch.device("cpu"), engine) == (link.d2h_gbps, link.h2d_gbps)
    doc = link.as_dict()
    assert doc["engine"] == "thread" and set(doc["per_size"]) == {str(n) for n in bandwidth_module.CPU_SIZES}
    engine.close()
