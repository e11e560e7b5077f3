from __future__ import annotations

from pathlib import Path

import pytest

from hyperpar.offload import StepReport
from hyperpar.offload.ir import IRFormatError


def test_report_json_round_trip_and_one_line_str(tmp_path: Path) -> None:
    report = StepReport(phase="replay", op_count=12, peak_resident_bytes=3 << 20, budget_bytes=2 << 20,
                        bytes_d2h=5, bytes_h2d=7, demand_faults=1, step_ms=2.5, overshoot_bytes=1 << 20,
                        overshoot_op=4, offload_cap_hits=2, diverged_at=None)
    path = tmp_path / "report.json"
    report.save(path)
    assert StepReport.load(path) == report
    text = str(report)
    assert "\n" not in text and "replay" in text and "op 4" in text
    assert report.as_dict()["bytes_h2d"] == 7


def test_report_load_rejects_other_files(tmp_path: Path) -> None:
    path = tmp_path / "x.json"
    path.write_text('{"format": "hyperpar.report", "version": 1, "phase": "warmup"}')
    with pytest.raises(IRFormatError, match="missing"):
        StepReport.load(path)
    path.write_text('{"format": "hyperpar.trace", "version": 1}')
    with pytest.raises(IRFormatError, match="format"):
        StepReport.load(path)
