"""``hyperpar bench offload --quick`` runs end to end and writes every figure it reports."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from hyperpar.bench.headlines import headline
from hyperpar.cli import main


def test_quick_mode_writes_ratios_and_prediction_error(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # without --out the JSON goes to ./hyperpar-bench/, never to the results
    out = tmp_path / "hyperpar-bench" / "offload.json"
    threads = torch.get_num_threads()
    try:
        assert main(["bench", "offload", "--quick"]) == 0
    finally:
        torch.set_num_threads(threads)
    doc = json.loads(out.read_text())
    assert doc["provenance"]["machine"]["cpu_model"]
    assert [f["name"] for f in doc["headline"]] == [f["name"] for f in headline("offload", doc)]
    assert doc["benchmark"] == "offload" and doc["torch"] == torch.__version__
    assert doc["machine"]["cpu_count"] and "bench offload --quick" in doc["command"]
    assert doc["command"].endswith("--out hyperpar-bench/offload.json")
    assert doc["plain_step_ms"] > 0 and len(doc["plain_step_ms_all"]) == doc["steps"] == 3
    peak, half = doc["replay_at_peak"], doc["replay_at_50"]
    assert peak["bytes_d2h"] == 0 and peak["demand_faults"] == 0  # nothing needs to move at the peak
    assert half["bytes_d2h"] > 0 and half["copy_engine"] == "thread"
    for r in (peak, half):
        assert math.isfinite(r["ratio_to_plain"]) and r["ratio_to_plain"] > 0
        assert r["predicted_step_ms"] > 0 and math.isfinite(r["prediction_error"])
    floor = doc["passthrough"]
    assert floor["step_ms"] > 0 and math.isfinite(floor["ratio_to_plain"])
    printed = capsys.readouterr().out
    assert "replay_at_peak" in printed and "replay_at_50" in printed and "passthrough" in printed


def test_one_variant_alone_writes_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "offload.json"
    threads = torch.get_num_threads()
    try:
        assert main(["bench", "offload", "--quick", "--steps", "2", "--variant", "replay",
                     "--out", str(out)]) == 0
    finally:
        torch.set_num_threads(threads)
    assert not out.exists()
    assert capsys.readouterr().out.startswith("replay: median ")
