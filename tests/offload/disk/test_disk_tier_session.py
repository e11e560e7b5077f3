"""The disk tier under a session (issue 42): host copies beyond ``max_host_activation_mb`` go
to a file in ``disk_dir`` and come back through host; gradients stay bitwise, the host
budget holds, and the file is gone when the session closes or a step fails."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

from hyperpar.offload import OffloadConfig, OffloadSession, StepReport
from hyperpar.offload.runtime.disk_store import FILE_PREFIX

MIB = 1 << 20


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
                           for _ in range(6)])


def _x(step: int) -> torch.Tensor:
    return torch.randn(256, 64, generator=torch.Generator().manual_seed(step))


Loss = Callable[[nn.Module, int], torch.Tensor]  # (model, step) -> the step's loss


def _mlp_loss(model: nn.Module, step: int) -> torch.Tensor:
    return model(_x(step)).square().mean()


def _run(model: nn.Module, loss_of: Loss, step: int, session: OffloadSession | None) -> torch.Tensor:
    torch.manual_seed(step)  # dropout: the same masks plain and in the session
    if session is None:
        loss = loss_of(model, step)
        loss.backward()
        return loss.detach()
    with session:
        loss = loss_of(model, step)
        loss.backward()
    return loss.detach()


def _step(model: nn.Module, step: int, session: OffloadSession | None = None) -> torch.Tensor:
    return _run(model, _mlp_loss, step, session)


def _said_past(session: OffloadSession) -> bool:
    """Whether the session's last step read a copy back past the host budget (and said so)."""
    tier = session._manager.tier
    return tier is not None and tier._said_past_budget


def _twin(plain: nn.Module, off: nn.Module, session: OffloadSession, loss_of: Loss,
          steps: Iterable[int], host_held: bool = True) -> Iterator[StepReport]:
    """Each step plainly and in the session: loss and every gradient bitwise, the host budget
    held (``host_held``; past it only for a read no room could be made for, which the tier
    says); then the step's report."""
    for step in steps:
        assert torch.equal(_run(plain, loss_of, step, None), _run(off, loss_of, step, session)), step
        for (name, p), q in zip(plain.named_parameters(), off.parameters(), strict=True):
            assert (p.grad is None) == (q.grad is None), (step, name)
            assert p.grad is None or torch.equal(p.grad, q.grad), f"step {step}: {name}'s gradient differs"
            p.grad = q.grad = None
        report = session.last_report
        assert report is not None
        assert (not host_held or report.peak_host_bytes <= (session.config.host_budget_bytes or 0)
                or _said_past(session)), str(report)
        yield report


def _twin_steps(plain: nn.Module, off: nn.Module, session: OffloadSession,
                steps: Iterable[int]) -> Iterator[StepReport]:
    """``_twin`` of the MLP's steps, the host budget left to the caller."""
    return _twin(plain, off, session, _mlp_loss, steps, host_held=False)


def _peak() -> int:
    probe = OffloadSession(OffloadConfig(max_resident_activation_mb=1e6))
    _step(_model(), 0, probe)
    assert probe.last_report is not None
    return probe.last_report.peak_resident_bytes


def _files(directory: Path) -> list[str]:
    return [name for name in os.listdir(directory) if name.startswith(FILE_PREFIX)]


@pytest.fixture(autouse=True)
def _one_thread() -> object:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # bitwise comparisons: plain PyTorch on 2 threads is not deterministic
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize(("device_share", "host_share"), [(0.6, 0.1), (0.6, 0.3), (0.8, 0.08), (1.0, 0.2)])
def test_gradients_stay_bitwise_and_the_host_budget_holds(tmp_path: Path, device_share: float,
                                                          host_share: float) -> None:
    peak = _peak()
    host_budget = host_share * peak
    session = OffloadSession(OffloadConfig(max_resident_activation_mb=device_share * peak / MIB,
                                           max_host_activation_mb=host_budget / MIB, disk_dir=tmp_path))
    plain, off = _model(), _model()
    spilled = read = 0
    for report in _twin_steps(plain, off, session, range(5)):
        # the device budget holds, except where the host budget had no room for a copy (a slab
        # the size of 2/3 of this host budget, whose room in-flight copies may hold, however the
        # copies are timed): the storage stays on the device, and the report says so
        assert (report.peak_resident_bytes <= report.budget_bytes * 1.02 + 64 * 1024
                or report.offload_cap_hits > 0 or report.replay_path == "fallback"), str(report)
        # the host held no more than its budget: the pool's arenas, page-aligned so that direct
        # I/O moves its slabs in place (the store makes no staging buffer); past it only for a
        # read no room could be made for (copies on their way out held it), which is said
        assert report.peak_host_bytes <= (session.config.host_budget_bytes or 0) or _said_past(session), \
            str(report)
        spilled += report.bytes_to_disk
        read += report.bytes_from_disk
        if device_share < 1.0:
            assert report.bytes_d2h > 0
    if device_share < 1.0:
        assert spilled > 0, "nothing went to disk though the host budget is a fraction of what moved"
        assert read > 0, "nothing came back from disk: backward read no spilled activation"
        assert _files(tmp_path), "the store's file lives while the session does"
    session.close()
    assert _files(tmp_path) == [], "close() unlinks the store's file"
    # the session stays usable after close(): the file comes back at the next spill
    assert torch.equal(_step(plain, 9), _step(off, 9, session))
    session.close()
    assert _files(tmp_path) == []


def test_a_step_that_raises_leaves_no_file_and_every_kept_tensor_whole(tmp_path: Path) -> None:
    peak = _peak()
    session = OffloadSession(OffloadConfig(max_resident_activation_mb=0.6 * peak / MIB,
                                           max_host_activation_mb=0.1 * peak / MIB, disk_dir=tmp_path))
    model, twin = _model(), _model()
    _step(model, 0, session)  # warmup: the plan
    kept: list[torch.Tensor] = []
    expected: list[torch.Tensor] = []
    with pytest.raises(ValueError, match="boom"):
        with session:
            h = _x(1)
            for layer in model:
                h = layer(h)
                kept.append(h)
            with torch.no_grad():
                ref = _x(1)
                for layer in twin:
                    ref = layer(ref)
                    expected.append(ref)
            h.square().mean().backward()
            assert session._manager.bytes_to_disk > 0, "the failing step spilled nothing: it tests no disk"
            raise ValueError("boom")
    assert _files(tmp_path) == [], "a failed step unlinks the store's file"
    for got, want in zip(kept, expected, strict=True):
        assert torch.equal(got.detach(), want), "an activation the user kept came back other than it left"
    _step(model, 2, session)  # and the next step runs
    session.close()


def test_files_are_removed_at_interpreter_exit_without_close(tmp_path: Path) -> None:
    code = f"""
import torch
from torch import nn
from hyperpar.offload import OffloadConfig, OffloadSession
torch.manual_seed(0)
m = nn.Sequential(*[nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64)) for _ in range(6)])
s = OffloadSession(OffloadConfig(max_resident_activation_mb=0.5, max_host_activation_mb=0.2,
                                 disk_dir={str(tmp_path)!r}))
for _ in range(2):
    with s:
        m(torch.randn(256, 64)).square().mean().backward()
assert s.last_report.bytes_to_disk > 0, s.last_report
print("spilled", s.last_report.bytes_to_disk)
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "spilled" in done.stdout
    assert _files(tmp_path) == []


@pytest.mark.parametrize(("kwargs", "error", "match"), [
    ({"max_host_activation_mb": 64}, ValueError, "needs OffloadConfig.disk_dir"),
    ({"disk_dir": "/tmp"}, ValueError, "needs OffloadConfig.max_host_activation_mb"),
    ({"max_host_activation_mb": 0, "disk_dir": "/tmp"}, ValueError, "must be > 0"),
    ({"max_host_activation_mb": -1, "disk_dir": "/tmp"}, ValueError, "max_host_activation_mb"),
    ({"max_host_activation_mb": "64", "disk_dir": "/tmp"}, TypeError, "max_host_activation_mb"),
    ({"max_host_activation_mb": 64, "disk_dir": 3}, TypeError, "disk_dir"),
])
def test_bad_disk_tier_settings_fail_when_the_config_is_built(kwargs: dict[str, object],
                                                              error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        OffloadConfig(**kwargs)  # type: ignore[arg-type]


def test_a_missing_or_non_directory_disk_dir_fails_when_the_session_is_built(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(FileNotFoundError, match="nope"):
        OffloadSession(OffloadConfig(max_host_activation_mb=8, disk_dir=missing))
    a_file = tmp_path / "f"
    a_file.write_text("x")
    with pytest.raises(NotADirectoryError, match="not a directory"):
        OffloadSession(OffloadConfig(max_host_activation_mb=8, disk_dir=a_file))


@pytest.mark.usefixtures("steady_link")  # asserts which path a plan takes (tests/offload/conftest.py)
def test_a_fast_step_whose_copy_finds_no_host_room_hands_over_to_the_dispatch_mode(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A host budget below one storage the plan moves: no copy out finds room, so the storage
    stays on the device past the plan's bytes. The checked replay says so (host cap hits) and
    teaches the fast path nothing: every step is checked, none falls back, and each reports
    its real peak over the budget. (A fast step whose copies find no room all the same hands
    over to the dispatch mode: ``test_a_fast_step_whose_end_fails_leaves_no_mode_and_no_file``.)
    The session says so once, when it plans."""
    caplog.set_level(logging.WARNING, logger="hyperpar.offload.api.session")
    peak = _peak()
    session = OffloadSession(OffloadConfig(max_resident_activation_mb=0.6 * peak / MIB,
                                           max_host_activation_mb=0.01, disk_dir=tmp_path))
    plain, off = _model(), _model()
    paths = []
    for report in _twin_steps(plain, off, session, range(6)):
        paths.append(report.replay_path)
        if report.replay_path != "fast":
            assert report.peak_resident_bytes > report.budget_bytes, "no copy left: the step must be over"
    assert paths[1:] == ["checked"] * 5, paths
    said = [r.getMessage() for r in caplog.records if "host budget" in r.getMessage()]
    assert len(said) == 1 and "stay on the device" in said[0], said
    session.close()


@pytest.mark.usefixtures("steady_link")
def test_the_fast_path_runs_through_the_disk_tier(tmp_path: Path) -> None:
    """A plan whose host copies exceed the host budget still runs on the fast path: its copies
    go through the tier (written out, read back) and gradients stay bitwise."""
    peak = _peak()
    session = OffloadSession(OffloadConfig(max_resident_activation_mb=0.6 * peak / MIB,
                                           max_host_activation_mb=0.2 * peak / MIB, disk_dir=tmp_path))
    plain, off = _model(), _model()
    fast_disk = 0
    for report in _twin_steps(plain, off, session, range(6)):
        assert report.peak_host_bytes <= (session.config.host_budget_bytes or 0) or _said_past(session), \
            str(report)
        if report.replay_path == "fast" and report.bytes_to_disk > 0 and report.bytes_from_disk > 0:
            fast_disk += 1
    assert fast_disk >= 3, "the fast path never moved bytes through the disk tier"
    session.close()
    assert _files(tmp_path) == []


def test_the_chrome_trace_shows_the_disk_tiers_writes_and_reads(tmp_path: Path) -> None:
    peak = _peak()
    disk = tmp_path / "disk"
    disk.mkdir()
    session = OffloadSession(OffloadConfig(max_resident_activation_mb=0.6 * peak / MIB, timeline=True,
                                           max_host_activation_mb=0.2 * peak / MIB, disk_dir=disk))
    model = _model()
    for step in range(2):  # warmup, then the checked replay the timeline records
        _step(model, step, session)
        for p in model.parameters():
            p.grad = None
    report = session.last_report
    assert report is not None and report.replay_path == "checked"
    assert report.bytes_to_disk > 0 and report.bytes_from_disk > 0
    doc = json.loads(session.export_chrome_trace(tmp_path / "trace.json").read_text())
    lanes: dict[str, list[dict[str, object]]] = {}
    for event in doc["traceEvents"]:
        if event.get("ph") == "X" and event.get("cat") in ("disk write", "disk read"):
            lanes.setdefault(str(event["cat"]), []).append(event)
    assert set(lanes) == {"disk write", "disk read"}, "the trace shows no disk I/O"
    for events in lanes.values():
        for event in events:  # within the step, on the step's clock
            start, end = float(event["ts"]), float(event["ts"]) + float(event["dur"])
            assert 0 <= start <= end <= report.step_ms * 1e3 + 5e4
    assert doc["otherData"]["step"]["bytes_to_disk"] == report.bytes_to_disk
    session.close()


@pytest.mark.usefixtures("steady_link")  # the same plan in the probe and the tiered session
def test_a_host_budget_the_plan_fits_in_writes_nothing_to_disk(tmp_path: Path) -> None:
    """Writing ahead of need past half the budget keeps room ready; where the plan's host copies
    fit the budget anyway, it would be disk I/O for nothing: the planned steps write none."""
    from hyperpar.offload.planning.host_tier import host_peak

    peak = _peak()
    device_mb = 0.6 * peak / MIB
    probe = OffloadSession(OffloadConfig(max_resident_activation_mb=device_mb))
    model = _model()
    for step in range(2):
        _step(model, step, probe)
        for p in model.parameters():
            p.grad = None
    assert probe.trace is not None and probe.schedule is not None
    needed = host_peak(probe.trace, probe.schedule)
    assert needed > 0
    session = OffloadSession(OffloadConfig(max_resident_activation_mb=device_mb,
                                           max_host_activation_mb=1.5 * needed / MIB, disk_dir=tmp_path))
    reports = list(_twin_steps(_model(), _model(), session, range(5)))
    assert all(r.bytes_d2h > 0 for r in reports[1:]), "the plan moves nothing: the test tests nothing"
    assert [r.bytes_to_disk for r in reports[1:]] == [0] * 4, [r.bytes_to_disk for r in reports]
    session.close()


@pytest.mark.usefixtures("steady_link")  # the same plan in both sessions
def test_a_plans_steps_write_only_what_the_host_budget_cannot_hold(tmp_path: Path) -> None:
    """With a plan the tier writes ahead of need only the copies its disk plan says must go
    (``planning.disk_plan``); without one (``_disk_plans`` off: the first step's policy on
    every step) it writes past half the budget whatever comes next. Both bitwise; at a host
    budget of 30 % of the MLP's peak the plan's steps wrote 576 KiB each against 1152-1216."""
    peak = _peak()
    written = {}
    for planned in (True, False):
        directory = tmp_path / str(planned)
        directory.mkdir()
        session = OffloadSession(OffloadConfig(max_resident_activation_mb=0.6 * peak / MIB,
                                               max_host_activation_mb=0.3 * peak / MIB, disk_dir=directory))
        session._disk_plans = planned
        reports = list(_twin_steps(_model(), _model(), session, range(6)))
        plan = session._current
        assert plan is not None and (plan.disk_plan is not None) == planned
        written[planned] = sum(r.bytes_to_disk for r in reports[1:])  # the steps with a plan
        session.close()
        assert _files(directory) == []
    assert 0 < written[True] <= 0.75 * written[False], written
