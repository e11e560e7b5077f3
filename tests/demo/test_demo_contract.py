"""The demo's promises checked in-process on the tiny GPT: exit code, files, table, launcher."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

import hyperpar.commands.demo as demo_command
from hyperpar.cli import main
from hyperpar.demo.dense import DemoSpec, train_dense
from hyperpar.demo.moe_ranks import MoeRunError, MoeSettings, run_moe_ranks
from hyperpar.demo.results import DemoResult, RunResult
from hyperpar.demo.table import render
from hyperpar.models import GPTConfig

TINY = ["demo", "--size", "tiny", "--steps", "2", "--no-moe"]


def test_tiny_run_writes_equal_losses_and_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*TINY, "--out", str(tmp_path), "--budget-fraction", "0.3"]) == 0
    doc = json.loads((tmp_path / "demo.json").read_text())
    assert doc["runs"]["baseline"]["losses_hex"] == doc["runs"]["offload"]["losses_hex"]
    runs = doc["runs"]
    assert runs["offload"]["budget_bytes"] == int(runs["baseline"]["peak_activation_bytes"] * 0.3)
    assert doc["settings"]["moe_ranks"] == 0 and "moe x2" not in doc["runs"]
    assert (tmp_path / "resident_bytes.png").stat().st_size > 1000
    assert "bitwise equal" in capsys.readouterr().out


def test_differing_losses_exit_non_zero(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    real = demo_command.train_dense

    def off_by_one_ulp(spec: DemoSpec, steps: int, **kwargs: object) -> tuple:
        result, model, session = real(spec, steps, **kwargs)
        if session is not None:
            result.losses[-1] = float.fromhex(result.losses[-1].hex()[:-1] + "1")  # flip the last bits
        return result, model, session

    monkeypatch.setattr(demo_command, "train_dense", off_by_one_ulp)
    assert main([*TINY, "--out", str(tmp_path)]) == 1
    captured = capsys.readouterr()
    assert "DIFFERENT" in captured.out and "offload changed the numbers" in captured.err
    doc = json.loads((tmp_path / "demo.json").read_text())
    assert doc["losses_equal"] is False and doc["weights_equal"] is True
    assert len(doc["differences"]) == 1 and doc["differences"][0].startswith("step 1: ")


def test_without_matplotlib_the_png_is_skipped_with_a_note(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(demo_command, "matplotlib_available", lambda: False)
    assert main([*TINY, "--out", str(tmp_path)]) == 0
    assert not (tmp_path / "resident_bytes.png").exists()
    assert "matplotlib is not installed" in capsys.readouterr().out


@pytest.mark.parametrize("argv, word", [(["--steps", "0"], "--steps"),
                                        (["--budget-fraction", "1.5"], "--budget-fraction")])
def test_bad_arguments_name_the_flag(argv: list[str], word: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["demo", *argv])
    assert exc.value.code == 2
    assert word in capsys.readouterr().err


def test_bad_device_and_out_are_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*TINY, "--device", "gpu", "--out", str(tmp_path)]) == 2
    assert "--device must be cpu or an available accelerator, got 'gpu'" in capsys.readouterr().err
    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("")
    assert main([*TINY, "--out", str(not_a_folder)]) == 2
    assert "--out must be a folder" in capsys.readouterr().err


def test_offload_run_equals_baseline_bitwise_at_a_quarter() -> None:
    spec = DemoSpec(cfg=GPTConfig.tiny(), batch_size=2, seed=3, device=torch.device("cpu"))
    base, base_model, _ = train_dense(spec, 3)
    off, off_model, session = train_dense(spec, 3, budget_bytes=4096)
    assert session is not None and session.phase == "replay"
    assert [x.hex() for x in base.losses] == [x.hex() for x in off.losses]
    for (name, a), (_, b) in zip(base_model.named_parameters(), off_model.named_parameters(), strict=True):
        assert torch.equal(a, b), name
    assert off.bytes_moved_per_step and off.bytes_moved_per_step > 0


def test_table_marks_a_difference() -> None:
    runs = [RunResult("baseline", [1.0, 2.0], [1.0, 1.0]), RunResult("offload", [1.0, 2.5], [1.0, 1.0])]
    text = render(DemoResult(settings={}, runs=runs, losses_equal=False, weights_equal=True))
    lines = [line for line in text.splitlines() if line.strip().startswith(("0", "1"))]
    assert lines[0].endswith("bitwise") and lines[1].endswith("DIFFERENT")


def test_moe_launcher_reports_every_rank_and_leaves_no_process() -> None:
    bad = MoeSettings(cfg=GPTConfig.tiny(), batch_size=2, seed=0, steps=1, num_experts=2, top_k=3)
    with pytest.raises(MoeRunError) as exc:
        run_moe_ranks(bad, world_size=2, timeout_s=60)
    text = str(exc.value)
    assert "--- rank 0 ---" in text and "--- rank 1 ---" in text and "top_k" in text
    assert mp.active_children() == []


def test_moe_launcher_kills_ranks_that_outlive_the_timeout() -> None:
    endless = MoeSettings(cfg=GPTConfig.tiny(), batch_size=2, seed=0, steps=10**7)
    with pytest.raises(MoeRunError, match="did not finish within 3 s"):
        run_moe_ranks(endless, world_size=2, timeout_s=3)
    assert mp.active_children() == []


def test_moe_launcher_checks_its_arguments() -> None:
    settings = MoeSettings(cfg=GPTConfig.tiny(), batch_size=2, seed=0, steps=1, num_experts=3)
    with pytest.raises(ValueError, match="num_experts=3 must be divisible by world_size=2"):
        run_moe_ranks(settings, world_size=2)
    with pytest.raises(ValueError, match="world_size"):
        run_moe_ranks(settings, world_size=0)


def test_gpu_runs_use_deterministic_kernels_and_restore_the_setting() -> None:
    before = torch.are_deterministic_algorithms_enabled()
    with demo_command._deterministic_kernels(torch.device("cuda")):
        assert torch.are_deterministic_algorithms_enabled()
    assert torch.are_deterministic_algorithms_enabled() == before
    with demo_command._deterministic_kernels(torch.device("cpu")):
        assert torch.are_deterministic_algorithms_enabled() == before
