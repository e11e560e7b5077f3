"""The compile-in-session benchmark runs end to end (tiny, aot_eager) and writes every variant."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_quick_run_writes_every_variant(tmp_path: Path) -> None:
    out = tmp_path / "compile.json"
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "compile_in_session.py"), "--quick",
                           "--backend", "aot_eager", "--out", str(out)],
                          capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads(out.read_text())
    assert doc["torch"] and doc["machine"]["cpu_count"] and "compile_in_session.py" in doc["command"]
    variants = doc["variants"]
    assert set(variants) == {"eager", "compiled", "session_peak", "session_50"}
    assert variants["compiled"]["wall_ratio_to_compiled"] == 1.0
    for name in ("session_peak", "session_50"):
        assert variants[name]["phase"] == "replay" and variants[name]["diverged_at"] is None, name
    assert variants["session_peak"]["bytes_d2h"] == 0 < variants["session_50"]["bytes_d2h"]
