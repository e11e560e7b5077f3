"""The demo's promises checked in-process on the tiny GPT: exit code, files, table, launcher."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

import hyperpar.commands.demo as demo_command
from hyperpar.cli import main
from hyperpar.demo.dense import DemoSpec, SideBySide, measure_activation_peak, train_dense, train_side_by_side
from hyperpar.demo.moe_ranks import MoeRunError, MoeSettings, run_moe_ranks
from hyperpar.demo.results import DemoResult, RunResult
from hyperpar.demo.table import cpu_ratio, render, timing_note
from hyperpar.models import GPTConfig
from hyperpar.offload import OffloadConfig

TINY = ["demo", "--size", "tiny", "--steps", "2", "--no-moe"]


def test_tiny_run_writes_equal_losses_and_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    threads = torch.get_num_threads()
    assert main([*TINY, "--out", str(tmp_path), "--budget-fraction", "0.3"]) == 0
    assert torch.get_num_threads() == threads  # pinned for the runs, restored after
    doc = json.loads((tmp_path / "demo.json").read_text())
    runs = doc["runs"]
    assert runs["baseline"]["losses_hex"] == runs["repeat"]["losses_hex"] == runs["offload"]["losses_hex"]
    assert doc["plain_repeats"] is True and doc["plain_differences"] == [] and doc["settings"]["threads"] == 1
    settings = doc["settings"]  # 30 % of the movable activation peak, the kept bytes beside it
    budget = int(settings["movable_peak_bytes"] * 0.3) + settings["kept_bytes"]
    assert runs["offload"]["budget_bytes"] == budget
    floor = runs["offload"]["min_feasible_budget_bytes"]
    assert floor == runs["offload"]["reports"][-1]["min_feasible_budget_bytes"] > 0
    assert doc["settings"]["moe_ranks"] == 0 and "moe x2" not in doc["runs"]
    for run in ("baseline", "repeat", "offload"):  # wall and CPU time for every step
        assert len(runs[run]["step_ms"]) == len(runs[run]["step_cpu_ms"]) == 2
    assert (tmp_path / "resident_bytes.png").stat().st_size > 1000
    out = capsys.readouterr().out
    assert "bitwise equal" in out and "feasible floor" in out and f"{floor / (1 << 20):.2f} MiB" in out
    fast_floor = runs["offload"]["fast_path_floor_bytes"]  # known from the checked replay (step 2)
    assert fast_floor == runs["offload"]["reports"][-1]["fast_path_floor_bytes"] >= floor
    assert "fast-path floor" in out and f"{fast_floor / (1 << 20):.2f}" in out


def test_budget_fraction_is_of_the_movable_peak_with_the_kept_bytes_beside_it(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--budget-fraction means what OffloadConfig.max_resident_fraction means: a share of the
    bytes a plan can move, not of a peak that counts parameter gradients as activations."""
    spec = DemoSpec(cfg=GPTConfig.tiny(), batch_size=2, seed=0, device=torch.device("cpu"))
    probe = measure_activation_peak(spec)
    # small batch: the parameter gradients are a large share of the step's bytes
    assert probe.kept_bytes > 0.2 * probe.movable_peak_bytes
    config = OffloadConfig(max_resident_fraction=0.4)
    want = config.budget_for_peak(probe.movable_peak_bytes, probe.kept_bytes)
    assert probe.budget(0.4) == want != max(1, int(probe.peak_bytes * 0.4))  # the old arithmetic
    assert main([*TINY, "--batch-size", "2", "--budget-fraction", "0.4", "--out", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "demo.json").read_text())
    settings, offload = doc["settings"], doc["runs"]["offload"]
    assert (settings["movable_peak_bytes"], settings["kept_bytes"]) == (probe.movable_peak_bytes,
                                                                        probe.kept_bytes)
    assert settings["budget_fraction_of"].startswith("movable activation peak")
    assert offload["budget_bytes"] == want == offload["reports"][-1]["budget_bytes"]
    assert doc["runs"]["baseline"]["peak_activation_bytes"] == probe.peak_bytes
    out = capsys.readouterr().out
    assert f"offload budget {want / (1 << 20):.2f} MiB (40% of the movable activation peak" in out


def _spoil(monkeypatch: pytest.MonkeyPatch, run: str, what: str) -> None:
    """Make one run's last loss (or one weight) differ in the last bits."""
    real = demo_command.train_side_by_side

    def spoiled(spec: DemoSpec, steps: int, **kwargs: object) -> SideBySide:
        runs = real(spec, steps, **kwargs)
        if what == "loss":
            result = getattr(runs, run)
            result.losses[-1] = float.fromhex(result.losses[-1].hex()[:-1] + "1")  # flip the last bits
        else:
            with torch.no_grad():
                next(runs.models[run].parameters()).view(-1)[0] += 1e-3
        return runs

    monkeypatch.setattr(demo_command, "train_side_by_side", spoiled)


def test_offload_that_changes_the_numbers_is_blamed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    _spoil(monkeypatch, "offload", "loss")
    assert main([*TINY, "--out", str(tmp_path)]) == demo_command.EXIT_OFFLOAD_DIFFERS == 1
    captured = capsys.readouterr()
    assert "DIFFERENT" in captured.out and "offload changed the numbers" in captured.err
    assert "did not repeat" not in captured.out + captured.err
    doc = json.loads((tmp_path / "demo.json").read_text())
    assert doc["losses_equal"] is False and doc["weights_equal"] is True and doc["plain_repeats"] is True
    assert len(doc["differences"]) == 1 and doc["differences"][0].startswith("step 1: ")


@pytest.mark.parametrize("what", ["loss", "weight"])
def test_plain_pytorch_that_does_not_repeat_is_not_blamed_on_offload(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        what: str) -> None:
    _spoil(monkeypatch, "repeat", what)
    assert main([*TINY, "--out", str(tmp_path)]) == demo_command.EXIT_PLAIN_NOT_REPRODUCIBLE == 3
    captured = capsys.readouterr()
    assert "two plain PyTorch runs of the same steps from the same seed differ" in captured.err
    assert "Not an offload problem" in captured.err and "offload changed the numbers" not in captured.err
    assert "offload not judged" in captured.out
    doc = json.loads((tmp_path / "demo.json").read_text())
    assert doc["plain_repeats"] is False and len(doc["plain_differences"]) == 1
    assert doc["losses_equal"] is True and doc["weights_equal"] is True  # offload itself still matched


def test_a_failed_moe_run_has_its_own_exit_code(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    def broken(*args: object, **kwargs: object) -> RunResult:
        raise MoeRunError("rank 1 died")

    monkeypatch.setattr(demo_command, "run_moe_ranks", broken)
    argv = ["demo", "--size", "tiny", "--steps", "1", "--out", str(tmp_path)]
    assert main(argv) == demo_command.EXIT_MOE_FAILED == 4
    assert "error: rank 1 died" in capsys.readouterr().err


def test_threads_are_pinned_for_the_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen = []
    real = demo_command.train_side_by_side

    def spy(spec: DemoSpec, steps: int, **kwargs: object) -> SideBySide:
        seen.append(torch.get_num_threads())
        return real(spec, steps, **kwargs)

    monkeypatch.setattr(demo_command, "train_side_by_side", spy)
    before = torch.get_num_threads()
    assert main([*TINY, "--steps", "1", "--threads", "2", "--out", str(tmp_path)]) == 0
    assert main([*TINY, "--steps", "1", "--out", str(tmp_path)]) == 0
    assert seen == [2, 1] and torch.get_num_threads() == before


def test_side_by_side_runs_take_turns_on_the_same_batches() -> None:
    spec = DemoSpec(cfg=GPTConfig.tiny(), batch_size=2, seed=5, device=torch.device("cpu"))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        runs = train_side_by_side(spec, 3, budget_bytes=4096)
        alone, _, _ = train_dense(spec, 3)
    finally:
        torch.set_num_threads(threads)
    hexes = [[x.hex() for x in r.losses] for r in (runs.baseline, runs.repeat, runs.offload, alone)]
    assert hexes[0] == hexes[1] == hexes[2] == hexes[3]
    assert runs.session.phase == "replay" and runs.offload.bytes_moved_per_step
    assert all(len(r.step_cpu_ms) == 3 and min(r.step_cpu_ms) > 0 for r in (runs.baseline, runs.offload))


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
    runs = [RunResult("baseline", [1.0, 2.0], [1.0, 1.0]), RunResult("repeat", [1.0, 2.0], [1.0, 1.0]),
            RunResult("offload", [1.0, 2.5], [1.0, 1.0])]
    text = render(DemoResult(settings={}, runs=runs, losses_equal=False, weights_equal=True))
    lines = [line.split() for line in text.splitlines() if line.strip().startswith(("0", "1"))][:2]
    assert lines[0][-2:] == ["bitwise", "bitwise"] and lines[1][-2:] == ["bitwise", "DIFFERENT"]
    assert len(lines[0]) == 5  # step, baseline, offload and the two checks: the repeat has no loss column


def test_cpu_ratio_pairs_steps_and_skips_the_first() -> None:
    base = RunResult("baseline", [1.0] * 4, [1.0] * 4, step_cpu_ms=[50.0, 10.0, 20.0, 40.0])
    off = RunResult("offload", [1.0] * 4, [1.0] * 4, step_cpu_ms=[500.0, 11.0, 30.0, 40.0])
    assert cpu_ratio(off, base) == 1.1  # median of 1.1, 1.5, 1.0
    assert cpu_ratio(off, RunResult("baseline", [], [])) is None


@pytest.mark.parametrize("loads, busy", [([0.3, 0.5], False), ([0.5, 1.9], True)])
def test_timing_note_says_when_the_machine_was_busy(loads: list[float], busy: bool) -> None:
    result = DemoResult(settings={"cpus": 2}, runs=[], losses_equal=True, weights_equal=True,
                        load_average=loads)
    text = " ".join(timing_note(result).split())
    assert f"load average {loads[0]:.1f} at the start, {loads[1]:.1f} at the end, on 2 CPUs" in text
    assert ("wall times are noisy" in text) is busy


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


def test_a_budget_below_the_floor_is_said_once(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    with caplog.at_level(logging.WARNING):
        assert main([*TINY, "--steps", "3", "--budget-fraction", "0.05", "--out", str(tmp_path)]) == 0
    said = [r.getMessage() for r in caplog.records if "below the feasible floor" in r.getMessage()]
    doc = json.loads((tmp_path / "demo.json").read_text())
    floor = doc["runs"]["offload"]["min_feasible_budget_bytes"]
    assert len(said) == 1 and f"floor of {floor / (1 << 20):.2f} MiB" in said[0]
    assert not [r for r in caplog.records if "exceeds the budget" in r.getMessage()]
    out = capsys.readouterr().out
    assert "is below the feasible floor" in out  # the note under the table says why it is over
