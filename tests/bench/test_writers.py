"""Every benchmark writer writes provenance and the headline ``headlines.py`` defines for its file.

The cheap benchmarks run for real at a tiny size into a temporary folder; the expensive
ones are checked through the writer they call (``headlines.write``) on their committed data.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from hyperpar.bench import headlines

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"

CHEAP = {  # stem -> arguments of a run that takes a few seconds
    "grown_steps": ["benchmarks/grown_steps.py", "--fractions", "0.4"],
    "tiny_ops": ["benchmarks/tiny_ops.py", "--layers", "40"],
    "replay_overhead": ["benchmarks/replay_overhead.py", "--steps", "3"],
    "host_pool": ["-m", "hyperpar.bench.host_pool", "--steps", "20", "--session-steps", "3"],
    "demo_step": ["benchmarks/demo_step.py", "--steps", "3", "--settle", "1"],
    "fast_paths": ["benchmarks/fast_paths.py", "--families", "tiny-ops", "--fractions", "0.5", "--steps", "3",
                   "--tiny-layers", "20"],
    "disk_store": ["benchmarks/disk_store.py", "--mib", "16", "--sizes", "1", "4", "--repeats", "1"],
    "disk_tier": ["benchmarks/disk_tier.py", "--size", "tiny", "--batch-size", "8", "--steps", "3",
                  "--settle", "1", "--rss-steps", "2", "--raw-mib", "16"],
}
EXPENSIVE = ("moe", "compile", "variable_lengths", "variable_shapes_models", "fuzz_failures",
             "multicore_hang_paths", "warmup_budget", "planner", "offload", "host_cost",
             "host_cost_mechanisms", "gpu_projection", "whole_model_projection", "recompute_cpu")


def _names(stem: str, doc: dict[str, Any]) -> list[str]:
    return [fig["name"] for fig in headlines.headline(stem, doc)]


def _check(doc: dict[str, Any], stem: str) -> None:
    prov = doc["provenance"]
    assert prov["commit"] and prov["machine"]["cpu_model"] and prov["load_average"]["end"] is not None
    data = {k: v for k, v in doc.items() if k not in ("provenance", "headline")}
    names = [fig["name"] for fig in doc["headline"]]
    assert names and names == _names(stem, data)


@pytest.mark.parametrize("stem", sorted(CHEAP))
def test_cheap_benchmark_writes_provenance_and_headline(stem: str, tmp_path: Path) -> None:
    out = tmp_path / f"{stem}.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT), os.environ.get("PYTHONPATH", "")])}
    argv = [str(ROOT / a) if a.startswith("benchmarks/") else a for a in CHEAP[stem]]
    subprocess.run([sys.executable, *argv, "--out", str(out)], cwd=tmp_path, env=env,
                   check=True, capture_output=True, timeout=120)
    _check(json.loads(out.read_text()), stem)


@pytest.mark.parametrize("stem", EXPENSIVE)
def test_writer_of_expensive_benchmark_writes_provenance_and_headline(stem: str, tmp_path: Path) -> None:
    committed = json.loads((RESULTS / f"{stem}.json").read_text())
    data = {k: v for k, v in committed.items() if k not in ("provenance", "headline")}
    out = tmp_path / "sub" / f"{stem}.json"
    headlines.write(stem, out, data, started=None)
    _check(json.loads(out.read_text()), stem)


def test_labelled_runs_without_after_have_no_headline_yet() -> None:
    assert headlines.headline("fuzz_failures", {"before_a4f59db": {"ok": 1, "cases": 2}}) == []
    assert headlines.headline("multicore_hang_paths", {"before": {}}) == []


def test_comparison_files_have_provenance_and_an_empty_headline(tmp_path: Path) -> None:
    doc = headlines.write("moe_before_after", tmp_path / "x.json", {"summary": {}})
    assert doc["provenance"]["command"] and doc["headline"] == []
