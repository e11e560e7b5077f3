"""``python -m hyperpar.bench.host_pool`` with few steps: its figures back what it claims."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from hyperpar.bench import host_pool


def test_host_pool_benchmark_writes_flat_figures(tmp_path: Path) -> None:
    out = tmp_path / "host_pool.json"
    parser = argparse.ArgumentParser()
    host_pool.add_arguments(parser)
    args = parser.parse_args(["--steps", "60", "--session-steps", "0", "--out", str(out)])
    assert host_pool.run(args) == 0
    doc = json.loads(out.read_text())
    assert doc["command"].startswith("python -m hyperpar.bench.host_pool") and doc["torch"]
    for path in ("pool_plain", "pool_pinned"):
        steps = doc[path]["steps"]
        assert set(steps) == {"50", "60"}
        for point in steps.values():
            assert point["held_mib"] <= 2.5 * point["max_step_need_mib"]
        assert steps["50"]["allocations"] == steps["60"]["allocations"]
