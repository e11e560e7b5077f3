"""The GPU benchmark script runs end to end on CPU with the tiny size and writes every variant."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "gpu" / "run.py"
VARIANTS = {"no_offload", "hyperpar_50", "hyperpar_30", "save_on_cpu", "checkpoint"}


def test_cpu_tiny_run_writes_every_variant_with_numbers(tmp_path: Path) -> None:
    out = tmp_path / "gpu.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--device", "cpu", "--size", "tiny", "--steps", "2", "--out", str(out)],
        capture_output=True, text=True, timeout=60, cwd=REPO,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads(out.read_text())
    assert doc["torch"] and doc["machine"]["cpu_count"] and "run.py" in doc["command"]
    assert set(doc["variants"]) == VARIANTS
    for name, r in doc["variants"].items():
        assert r["ok"], (name, r.get("error"), r.get("traceback"))
        assert math.isfinite(r["step_ms"]) and r["step_ms"] > 0, name
        assert isinstance(r["peak_memory_bytes"], int), name
        assert len(r["step_ms_all"]) == 2, name
        assert r["loss_equal_to_no_offload"], name  # same model, same batch: bitwise same loss
    assert doc["activation_peak_bytes"] > 0
    assert doc["variants"]["hyperpar_30"]["budget_mb"] < doc["variants"]["hyperpar_50"]["budget_mb"]
    assert doc["variants"]["hyperpar_30"]["report"]["phase"] == "replay"
    assert doc["bandwidth"]["d2h_gbps"] > 0 and doc["bandwidth"]["h2d_gbps"] > 0
    assert "hyperpar_30" in proc.stdout and "x plain" in proc.stdout
    for name in ("hyperpar_50", "hyperpar_30"):  # host cost per op measured, the projection beside it
        row = doc["projection"][name]
        assert row["host_us_per_op"]["plain_us"] > 0 and row["host_us_per_op"]["replay_us"] > 0, row
        assert row["projected_ms"]["replay"] > 0 and row["measured_ms"]["replay"] > 0, row


def test_runtime_check_passes_on_cpu() -> None:
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "gpu" / "check_runtime.py"), "--device", "cpu"],
        capture_output=True, text=True, timeout=120, cwd=REPO,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "all checks passed" in proc.stdout and "FAIL" not in proc.stdout
    assert proc.stdout.count("bitwise equal") == 12
