"""StepReport timing fields and the Chrome trace of the last replay (and what it rebuilt)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hyperpar.models import GPT, GPTConfig, random_batch
from hyperpar.offload import OffloadConfig, OffloadSession
from hyperpar.offload.api.session import STEP_TOTALS
from tests.offload.test_recompute import _steps


def _run(session: OffloadSession, steps: int) -> None:
    torch.manual_seed(0)
    cfg = GPTConfig.tiny()
    model = GPT(cfg)
    batch = random_batch(cfg, 2, torch.Generator().manual_seed(0))
    for _ in range(steps):
        model.zero_grad(set_to_none=True)
        with session:
            model.loss(*batch).backward()


def test_chrome_trace_has_op_and_copy_tracks(tmp_path: Path) -> None:
    session = OffloadSession(OffloadConfig(max_resident_activation_mb=0, device="cpu", timeline=True))
    _run(session, 1)
    with pytest.raises(RuntimeError, match="no replay timeline yet"):
        session.export_chrome_trace(tmp_path / "none.json")
    _run(session, 1)
    untimed = OffloadSession(OffloadConfig(max_resident_activation_mb=0, device="cpu"))
    _run(untimed, 2)
    with pytest.raises(RuntimeError, match=r"timeline=True"):
        untimed.export_chrome_trace(tmp_path / "off.json")
    report = session.last_report
    assert report is not None and report.phase == "replay"
    path = session.export_chrome_trace(tmp_path / "replay.json")
    doc = json.loads(path.read_text())
    events = doc["traceEvents"]
    names = {e["tid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert set(names.values()) == {"compute", "D2H", "H2D"}
    by_track: dict[str, list[dict]] = {n: [] for n in names.values()}
    for e in events:
        if e["ph"] == "X":
            assert e["dur"] >= 0 and e["ts"] >= -1.0
            by_track[names[e["tid"]]].append(e)
    assert len(by_track["compute"]) == report.op_count
    assert by_track["compute"][0]["name"].startswith("aten.")
    assert sum(e["args"]["bytes"] for e in by_track["D2H"]) == report.bytes_d2h
    assert sum(e["args"]["bytes"] for e in by_track["H2D"]) == report.bytes_h2d
    starts = [e["ts"] for e in by_track["compute"]]
    assert starts == sorted(starts)


def test_report_fills_predicted_and_exposed_wait_and_warmup_times_ops(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # the default engine, by name (CI may set HYPERPAR_COPY_ENGINE)
    monkeypatch.delenv("HYPERPAR_COPY_ENGINE", raising=False)
    session = OffloadSession(OffloadConfig(max_resident_activation_mb=0, device="cpu"))
    _run(session, 2)
    report = session.last_report
    assert report is not None and report.predicted_step_ms is not None and report.predicted_step_ms > 0
    assert report.exposed_wait_ms >= 0.0
    assert session.trace is not None
    assert all(op.duration_ms >= 0 for op in session.trace.ops)
    assert sum(op.duration_ms for op in session.trace.ops) > 0
    assert session.trace.d2h_bandwidth_gbps > 0 and session.trace.h2d_bandwidth_gbps > 0
    assert session.link_bandwidth is not None and session.link_bandwidth["engine"] == "thread"


@pytest.mark.usefixtures("steady_link")  # the recompute tests' paths: the planner's link fixed
@pytest.mark.parametrize("recompute", ["layers", "off"])
def test_chrome_trace_says_what_the_step_rebuilt(tmp_path: Path, recompute: str) -> None:
    """Rebuilt module calls show in the timeline only as more ops: the trace carries the
    step's three choices (kept on the device, offloaded, rebuilt) as totals too."""
    session, reports = _steps(0.5, recompute=recompute, timeline=True)
    checked = [r for r in reports if r.replay_path == "checked"][-1]  # the last timed replay
    doc = json.loads(session.export_chrome_trace(tmp_path / "t.json").read_text())
    totals = doc["otherData"]["step"]
    markers = [e for e in doc["traceEvents"] if e["ph"] == "i" and e["name"] == "step"]
    assert len(markers) == 1 and markers[0]["args"] == totals
    assert totals == {name: getattr(checked, name) for name in STEP_TOTALS}
    assert {"bytes_d2h", "bytes_h2d", "bytes_recomputed"} <= totals.keys()
    if recompute == "layers":
        assert totals["bytes_recomputed"] > 0 and totals["bytes_recomputed"] == reports[-1].bytes_recomputed
    else:
        assert totals["bytes_recomputed"] == 0 and totals["bytes_d2h"] > 0
