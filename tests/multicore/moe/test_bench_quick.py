"""`hyperpar bench moe --quick` runs end to end on 2 gloo ranks and writes its JSON."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from hyperpar.bench import moe


def test_quick_benchmark_writes_results(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    moe.add_arguments(parser)
    out = tmp_path / "moe.json"
    assert moe.run(parser.parse_args(["--quick", "--steps", "2", "--out", str(out)])) == 0
    report = json.loads(out.read_text())
    assert report["torch"] and report["machine"]["cpus"] and report["command"]
    summary = report["summary"]["quick"]
    assert set(summary["fwd_bwd_ms_median_slowest_rank"]) == {"naive", "chunks=1", "chunks=2", "chunks=4"}
    assert summary["moe_over_naive"] > 0
    shared = summary["workspace_bytes_shared"]
    assert shared["1_layers"] > 0 and shared["1_layers"] == shared["4_layers"] == shared["8_layers"]
    for rank in report["per_rank"].values():
        assert max(rank["quick"]["max_abs_diff_vs_naive"].values()) < 1e-4  # same math as the baseline
    assert "MoeExperts/naive" in capsys.readouterr().out


@pytest.mark.parametrize("steps", ["0", "-2"])
def test_steps_must_be_positive(steps: str, capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    moe.add_arguments(parser)
    with pytest.raises(SystemExit):
        parser.parse_args(["--steps", steps])
    assert "must be a positive int" in capsys.readouterr().err
