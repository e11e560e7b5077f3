"""`hyperpar bench moe --quick` runs end to end on 2 gloo ranks and writes its JSON and plot."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from hyperpar.bench import moe
from hyperpar.bench.moe_peers import torchtitan_missing


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    moe.add_arguments(parser)
    return parser.parse_args(list(argv))


@pytest.mark.slow  # ~20-60 s on 2 shared cores: spawns 2 ranks that import torch (and torchtitan)
def test_quick_benchmark_writes_results(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "moe.json"
    argv = ["--quick", "--steps", "1", "--runs", "1", "--dtypes", "float32,bfloat16", "--out", str(out)]
    assert moe.run(_args(*argv)) == 0
    report = json.loads(out.read_text())
    assert report["torch"] and report["machine"]["cpus"] and report["command"]
    summary = report["summary"]["quick"]["float32"]
    peer = [] if torchtitan_missing() else ["torchtitan"]
    assert list(summary["cpu_ms_slowest_rank"]) == ["MoeExperts", "naive", moe.BF16_GEMMS, *peer]
    assert summary["moe_over_naive"]["median"] > 0
    moe_memory = summary["memory"]["MoeExperts"]
    assert moe_memory["rise_bytes"] > 0 and moe_memory["persistent_bytes"] > 0
    assert summary["memory"]["naive"]["persistent_bytes"] == 0
    diffs = summary["max_abs_diff_vs_moe"]
    assert diffs["naive"] < 1e-4  # same math in float32
    assert 1e-5 < diffs[moe.BF16_GEMMS] < 0.1 and all(diffs[p] < 0.1 for p in peer)  # bf16 GEMMs
    assert ("bf16_gemm_opt_in_over_torchtitan" in summary) == bool(peer)
    stack = report["stack"]["quick"]  # the extra row: serial bf16 layers sharing one workspace
    assert list(stack["memory"]) == ["MoeExperts", *peer] and stack["layers"] == 4
    kept = stack["memory"]["MoeExperts"]["persistent_bytes"]
    assert kept == report["summary"]["quick"]["bfloat16"]["memory"]["MoeExperts"]["persistent_bytes"] > 0
    assert ("moe_over_torchtitan" in stack) == bool(peer)
    shared = report["workspace_bytes_shared"]
    assert shared["1_layers"] > 0 and shared["1_layers"] == shared["4_layers"] == shared["8_layers"]
    assert (tmp_path / "moe.png").stat().st_size > 0
    printed = capsys.readouterr().out
    assert "MoeExperts/naive" in printed and "4 serial layers" in printed
    assert ("the MoeExperts row is strict fp32" in printed) == bool(peer)
    assert ("torchtitan's MoE is NOT measured" in printed) == (not peer)


def test_without_out_nothing_is_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(moe, "_one_run", lambda world, sizes, dtypes: (_ for _ in ()).throw(
        RuntimeError("rank 1 failed")))
    assert moe.run(_args("--quick", "--runs", "1")) == 1
    assert "moe benchmark failed: rank 1 failed" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("argv", [["--steps", "0"], ["--runs", "-2"]])
def test_counts_must_be_positive(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        _args(*argv)
    assert "must be a positive int" in capsys.readouterr().err


def test_unknown_dtype_is_rejected(capsys: pytest.CaptureFixture[str]) -> None:
    assert moe.run(_args("--quick", "--dtypes", "float16")) == 2
    assert "--dtypes: unknown ['float16']" in capsys.readouterr().err
