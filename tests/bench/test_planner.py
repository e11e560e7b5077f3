"""Smoke test of ``hyperpar bench planner --quick``: it runs end to end and reports its goals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hyperpar.bench.headlines import headline
from hyperpar.cli import main


def test_quick_planner_benchmark(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # without --out the JSON goes to ./hyperpar-bench/, never to the results
    assert main(["bench", "planner", "--quick"]) == 0
    out = tmp_path / "hyperpar-bench" / "planner.json"
    printed = capsys.readouterr().out
    assert "assumptions:" in printed and "GB/s" in printed
    assert "median exposed wait timed/greedy" in printed
    doc = json.loads(out.read_text())
    assert doc["provenance"]["machine"]["cpu_model"]
    assert [f["name"] for f in doc["headline"]] == [f["name"] for f in headline("planner", doc)]
    assert doc["command"] == "hyperpar bench planner --quick --out hyperpar-bench/planner.json"
    assert doc["torch"] and doc["machine"]["platform"] and doc["assumptions"]
    assert set(doc["models"]) == {"hyperpar-gpt", "cnn"}
    for model in doc["models"].values():
        assert [c["budget_fraction"] for c in model["cases"]] == [0.3, 0.5, 0.7]
        for case in model["cases"]:
            for planner in ("greedy", "timed"):
                point = case[planner]
                assert point["budget_bytes"] == case["budget_bytes"]
                assert point["deficit_bytes"] == max(0, point["predicted_peak_bytes"] - case["budget_bytes"])
                if point["deficit_bytes"] == 0:
                    assert point["exposed_wait_ms"] >= case["exposed_wait_lower_bound_ms"] - 1e-9
    assert doc["synthetic"]["ops"] >= 19_000
    assert doc["summary"]["synthetic_plan_cpu_seconds"]["timed"] > 0
