"""``hyperpar plan TRACE --host-budget-mb``: the three tiers of a small GPT's plan, and bad flags."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hyperpar.cli import main
from hyperpar.models import GPT, GPTConfig, random_batch
from hyperpar.offload import OffloadConfig, OffloadSession
from hyperpar.offload.ir import ActivationTrace, ResidencySchedule
from hyperpar.offload.planning.host_tier import host_tier
from hyperpar.offload.planning.simulate import SimResult

MIB = 1 << 20


@pytest.fixture(scope="module")
def gpt_trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One traced step of the small GPT (39 MiB of activations at batch 8), half its movable
    activation peak on the device."""
    torch.manual_seed(0)
    model = GPT(GPTConfig.small())
    session = OffloadSession(OffloadConfig(max_resident_fraction=0.5, device="cpu"))
    x, y = random_batch(model.cfg, batch_size=8)
    with session:
        model.loss(x, y).backward()
    assert session.trace is not None
    path = tmp_path_factory.mktemp("trace") / "trace.json"
    session.trace.save(path)
    return path


def _tier_rows(out: str) -> dict[str, list[str]]:
    return {line.split()[0]: line.split() for line in out.splitlines()
            if line.split() and line.split()[0] in ("device", "host", "disk")}


def test_the_table_shows_the_three_tiers(gpt_trace: Path, tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    trace = ActivationTrace.load(gpt_trace)
    budget_mb = trace.memory_limit_bytes / MIB
    assert main(["plan", str(gpt_trace), "--host-budget-mb", "4", "--disk-write-gbps", "2",
                 "--disk-read-gbps", "1", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    rows = _tier_rows(out)
    assert rows["device"][2] == f"{budget_mb:.1f}"  # the device budget is the trace's
    assert float(rows["host"][1]) <= 4.0 and rows["host"][2] == "4.0"  # held within the host budget
    to_disk, from_disk = float(rows["disk"][3]), float(rows["disk"][4])
    assert to_disk > 0 and from_disk > 0, out  # a host budget this small spills
    assert "without a host budget the host would hold" in out
    assert "writing at 2 GB/s" in out and "reading at 1 GB/s" in out and "ms of compute" in out


def test_the_table_matches_the_model(gpt_trace: Path, tmp_path: Path,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    """The printed figures are ``host_tier``'s on the plan the table shows."""
    assert main(["plan", str(gpt_trace), "--host-budget-mb", "4", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    schedule, sim = _schedule_of(gpt_trace)
    est = host_tier(ActivationTrace.load(gpt_trace), schedule, 4 * MIB, timeline=sim)
    rows = _tier_rows(out)
    assert rows["disk"][3:5] == [f"{est.bytes_to_disk / MIB:.1f}", f"{est.bytes_from_disk / MIB:.1f}"]
    assert f"{est.io_ms:.2f} ms against {est.compute_ms:.2f} ms of compute" in out
    assert est.disk_wait_ms is not None and est.step_with_disk_ms is not None
    assert f"the step waits {est.disk_wait_ms:.2f} ms for the disk" in out, out
    assert f"{est.step_with_disk_ms:.2f} ms against the plan's {sim.predicted_step_ms:.2f} ms" in out, out
    assert "writing at 2.49 GB/s" in out and "reading at 1.6 GB/s" in out  # the defaults


def _schedule_of(path: Path) -> tuple[ResidencySchedule, SimResult]:
    from hyperpar.offload.planning.deficit_warnings import deficit_warnings_muted
    from hyperpar.offload.planning.sweep import plan_point

    with deficit_warnings_muted():
        _, schedule, sim = plan_point(ActivationTrace.load(path), "timed")
    return schedule, sim


def test_without_the_flag_no_tiers(gpt_trace: Path, tmp_path: Path,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", str(gpt_trace), "--out", str(tmp_path)]) == 0
    assert not _tier_rows(capsys.readouterr().out)


def test_json_carries_the_host_tier(gpt_trace: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", str(gpt_trace), "--device", "h100", "--budget-fraction", "0.5", "--json",
                 "--host-budget-mb", "4"]) == 0
    doc = json.loads(capsys.readouterr().out)
    tier = doc["host_tier"]
    assert tier["host_budget_bytes"] == 4 * MIB and tier["write_gbps"] == 2.49
    assert {"bytes_to_disk", "bytes_from_disk", "peak_host_bytes", "io_ms", "compute_ms",
            "fits", "disk_wait_ms", "step_with_disk_ms"} <= tier.keys()
    # timed on the device's model: its step is a few ms, under the trace's CPU compute by far,
    # and the disk's I/O does not hide under it
    assert tier["compute_ms"] < 0.2 * sum(op.duration_ms for op in ActivationTrace.load(gpt_trace).ops)
    assert tier["disk_wait_ms"] > 0 and not tier["fits_projected"]
    assert tier["step_with_disk_ms"] == pytest.approx(tier["step_ms"] + tier["disk_wait_ms"])
    assert tier["projected_step_ms"] == doc["offload_only_ms"]
    assert tier["fits_projected"] == (tier["io_ms"] <= doc["offload_only_ms"])


@pytest.mark.parametrize(("flags", "match"), [
    (["--host-budget-mb", "0"], r"--host-budget-mb must be finite and > 0, got '0'"),
    (["--host-budget-mb", "lots"], r"--host-budget-mb must be a number of MiB, got 'lots'"),
    (["--host-budget-mb", "8", "--disk-write-gbps", "-1"],
     r"--disk-write-gbps must be finite and > 0, got '-1'"),
    (["--host-budget-mb", "8", "--disk-read-gbps", "nan"],
     r"--disk-read-gbps must be finite and > 0, got 'nan'"),
    (["--disk-read-gbps", "2"], r"--disk-write-gbps and --disk-read-gbps need --host-budget-mb"),
])
def test_bad_flags_name_the_flag_and_value(gpt_trace: Path, flags: list[str], match: str) -> None:
    with pytest.raises(SystemExit, match=match):
        main(["plan", str(gpt_trace), *flags])
