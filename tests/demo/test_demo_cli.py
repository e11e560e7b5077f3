"""`hyperpar demo` as a user runs it: a subprocess, the default model, 2 steps, MoE on 2 ranks."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hyperpar.offload.ir import ActivationTrace


@pytest.mark.slow
def test_demo_two_steps_losses_bitwise_equal(tmp_path: Path) -> None:
    out = tmp_path / "demo"
    proc = subprocess.run([sys.executable, "-m", "hyperpar", "demo", "--steps", "2", "--out", str(out)],
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads((out / "demo.json").read_text())
    runs = doc["runs"]
    assert sorted(runs) == ["baseline", "moe x2", "offload", "repeat"]
    assert doc["plain_repeats"] is True and runs["repeat"]["losses_hex"] == runs["baseline"]["losses_hex"]
    base, off, moe = runs["baseline"], runs["offload"], runs["moe x2"]
    # the claim of the demo: bitwise-equal losses (their exact bits are in the file) and weights
    assert len(base["losses_hex"]) == 2
    assert base["losses_hex"] == off["losses_hex"]
    assert doc["losses_equal"] is True and doc["weights_equal"] is True
    # offload really offloaded, at half the movable activation peak (the kept bytes beside it),
    # and the replay stayed under budget
    settings = doc["settings"]
    assert off["budget_bytes"] == int(settings["movable_peak_bytes"] * 0.5) + settings["kept_bytes"]
    assert off["budget_bytes"] < base["peak_activation_bytes"]
    assert off["bytes_moved_per_step"] > 0
    replay = off["reports"][-1]
    assert replay["phase"] == "replay" and replay["peak_resident_bytes"] <= replay["budget_bytes"]
    assert len(moe["losses"]) == 2 and all(5.0 < x < 8.0 for x in moe["losses"])
    assert any("replicas in sync: yes" in n for n in moe["notes"])
    # the table, the files
    assert "bitwise" in proc.stdout and "DIFFERENT" not in proc.stdout
    for bar in ("plain, repeat, offload:", "moe x2:"):  # one progress bar per launch, finished
        assert any(bar in line and "100%" in line for line in proc.stderr.replace("\r", "\n").splitlines())
    assert (out / "resident_bytes.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert ActivationTrace.load(out / "trace.json").num_ops == replay["op_count"]
    assert len(doc["resident_bytes_planned"]) == len(doc["resident_bytes_plain"]) == replay["op_count"]
    assert max(doc["resident_bytes_planned"]) <= off["budget_bytes"] < max(doc["resident_bytes_plain"])
