"""A release whose copy out is still running keeps its device bytes, and they count as
resident until the copy is done, so what a step holds never depends on copy timing."""

from __future__ import annotations

import torch

from hyperpar.offload.runtime import HostPool, ResidencyManager
from hyperpar.offload.runtime.chaos_copy_engine import ChaosCopyEngine

N = 1024


def _manager() -> ResidencyManager:
    return ResidencyManager(torch.device("cpu"), HostPool(1 << 20), ChaosCopyEngine(0, timing="never"))


def test_a_release_in_flight_counts_until_its_copy_is_done() -> None:
    m = _manager()
    t = torch.randn(N)
    want = t.clone()
    entry = m.bind(0, t.untyped_storage())
    assert m.copy_d2h(entry) and m.release_device(entry)
    assert m.pending_bytes == 4 * N and t.untyped_storage().nbytes() == 4 * N  # not freed yet
    m.reap()
    assert m.pending_bytes == 4 * N  # the copy has not run: nothing freed, still counted
    m.free_pending_until(1)
    assert m.pending_bytes == 0 and t.untyped_storage().nbytes() == 0
    m.copy_h2d(entry, demand=True)
    assert torch.equal(t, want) and m.engine.violations == []  # type: ignore[attr-defined]


def test_paging_in_before_the_copy_is_done_cancels_the_free() -> None:
    m = _manager()
    t = torch.randn(N)
    want = t.clone()
    entry = m.bind(0, t.untyped_storage())
    assert m.copy_d2h(entry) and m.release_device(entry)
    m.copy_h2d(entry, demand=True)
    assert m.pending_bytes == 0 and m.resident_bytes == 4 * N and torch.equal(t, want)


def test_waiting_frees_the_oldest_releases_first_and_only_as_many_as_needed() -> None:
    m = _manager()
    ts = [torch.randn(N) for _ in range(3)]
    entries = [m.bind(i, t.untyped_storage()) for i, t in enumerate(ts)]
    for e in entries:
        assert m.copy_d2h(e) and m.release_device(e)
    m.free_pending_until(4 * N + 1)  # more than one release's bytes: the two oldest
    assert [t.untyped_storage().nbytes() for t in ts] == [0, 0, 4 * N]
    assert m.pending_bytes == 4 * N
