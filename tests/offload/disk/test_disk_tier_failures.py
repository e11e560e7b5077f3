"""The disk tier off the happy path: a disk that fills, a read that fails, bytes that come
back other than they left (``verify=True``): nothing silently wrong, nothing left behind."""

from __future__ import annotations

import errno
import logging
from pathlib import Path

import pytest
import torch

from hyperpar.offload import OffloadConfig, OffloadSession
from hyperpar.offload.runtime import disk_store
from hyperpar.offload.runtime.residency_manager import HostCopyCorruptedError, RestoreError
from tests.offload.disk.test_disk_tier_session import MIB, _files, _model, _peak, _step, _twin_steps


@pytest.fixture(autouse=True)
def _one_thread() -> object:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _session(tmp_path: Path, verify: bool = False) -> OffloadSession:
    peak = _peak()
    return OffloadSession(OffloadConfig(max_resident_activation_mb=0.6 * peak / MIB,
                                        max_host_activation_mb=0.1 * peak / MIB, disk_dir=tmp_path,
                                        verify=verify))


def test_a_disk_that_fills_mid_step_keeps_gradients_bitwise_and_says_so(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    session = _session(tmp_path)
    plain, off = _model(), _model()
    assert torch.equal(_step(plain, 0), _step(off, 0, session))  # warmup spills fine
    assert session.last_report is not None and session.last_report.bytes_to_disk > 0
    writes = {"n": 0}
    real_grow = disk_store.DiskStore._grow

    def grow_then_fill(self: disk_store.DiskStore, end: int) -> None:
        writes["n"] += 1
        if writes["n"] > 1:
            raise disk_store.DiskFullError(errno.ENOSPC, "no room (test)")
        real_grow(self, end)

    session.close()  # the next spill opens a new file, which then fills after its first extent
    monkeypatch.setattr(disk_store.DiskStore, "_grow", grow_then_fill)
    for p in plain.parameters():
        p.grad = None
    for q in off.parameters():
        q.grad = None
    with caplog.at_level(logging.WARNING, logger="hyperpar.offload.runtime.disk_tier"):
        for _ in _twin_steps(plain, off, session, (1, 2)):
            pass
    assert writes["n"] > 1, "the disk never filled: the test tested nothing"
    said = [r.getMessage() for r in caplog.records if "spilling stops" in r.getMessage()]
    assert said and str(tmp_path) in said[0], "a full disk must be said, naming the directory"
    session.close()
    assert _files(tmp_path) == []


def test_a_failing_read_fails_the_step_naming_the_storage_and_leaves_no_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    session = _session(tmp_path)
    model = _model()
    _step(model, 0, session)

    def broken_read(self: disk_store.DiskStore, extent: disk_store.Extent, dst: torch.Tensor) -> None:
        raise OSError(errno.EIO, "read error (test)")

    monkeypatch.setattr(disk_store.DiskStore, "read", broken_read)
    with pytest.raises((OSError, RestoreError), match="read error"):
        _step(model, 1, session)
    assert _files(tmp_path) == [], "a failed step unlinks the store's file"
    monkeypatch.undo()
    _step(model, 2, session)  # the session runs on
    assert session.last_report is not None and session.last_report.bytes_to_disk > 0
    session.close()


def test_verify_catches_bytes_that_came_back_from_disk_other_than_they_left(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    session = _session(tmp_path, verify=True)
    model = _model()
    _step(model, 0, session)  # verify mode: the checksums hold through disk on a clean step
    assert session.last_report is not None and session.last_report.bytes_from_disk > 0
    real_read = disk_store.DiskStore.read

    def flipping_read(self: disk_store.DiskStore, extent: disk_store.Extent, dst: torch.Tensor) -> None:
        real_read(self, extent, dst)
        dst[0] ^= 1  # one bit, as a bad disk would

    monkeypatch.setattr(disk_store.DiskStore, "read", flipping_read)
    with pytest.raises((HostCopyCorruptedError, RestoreError), match="checksum"):
        _step(model, 1, session)
    assert _files(tmp_path) == []
    session.close()
