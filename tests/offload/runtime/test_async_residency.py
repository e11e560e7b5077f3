"""The residency manager on the thread engine: deferred frees, in-flight waits, slab ordering."""

from __future__ import annotations

import gc
import time

import pytest
import torch

from hyperpar.offload.runtime import HostCopyCorruptedError, HostPool, ResidencyManager, ThreadCopyEngine


def _manager(delay_s: float = 0.0, verify: bool = False) -> ResidencyManager:
    return ResidencyManager(torch.device("cpu"), HostPool(1 << 24), ThreadCopyEngine(delay_s), verify=verify)


def test_release_waits_for_the_copy_out_before_freeing_the_bytes() -> None:
    m = _manager(delay_s=0.05)
    t = torch.arange(256, dtype=torch.float32)
    expected = t.clone()
    entry = m.bind(0, t.untyped_storage())
    assert m.copy_d2h(entry) and m.release_device(entry)
    assert m.resident_bytes == 0 and m.offloaded_bytes == 1024  # accounted at once ...
    assert t.untyped_storage().nbytes() == 1024 and entry.free_pending  # ... freed once copied
    m.reap()
    assert t.untyped_storage().nbytes() == 1024  # copy still running: still there
    m.engine.wait(entry.d2h_event)
    m.reap()
    assert t.untyped_storage().nbytes() == 0 and not entry.free_pending
    m.copy_h2d(entry)
    assert entry.key in m.inflight
    m.page_in_inputs([t])  # the op about to read waits on this storage's event only
    assert torch.equal(t, expected) and not m.inflight and m.demand_faults == 0
    m.clear()


def test_page_in_before_the_free_cancels_it_without_a_copy() -> None:
    m = _manager(delay_s=0.05)
    t = torch.arange(64, dtype=torch.float32)
    entry = m.bind(0, t.untyped_storage())
    assert m.copy_d2h(entry) and m.release_device(entry)
    m.page_in_inputs([t])
    assert entry.resident and m.bytes_h2d == 0 and m.demand_faults == 1
    m.wait_all()
    m.reap()
    assert t.untyped_storage().nbytes() == 256 and torch.equal(t, torch.arange(64, dtype=torch.float32))
    m.clear()


def test_reused_slab_is_not_overwritten_while_a_copy_still_reads_it() -> None:
    m = _manager(delay_s=0.03)
    a = torch.full((128,), 1.0)
    b = torch.full((128,), 2.0)
    ea, eb = m.bind(0, a.untyped_storage()), m.bind(1, b.untyped_storage())
    assert m.copy_d2h(ea) and m.release_device(ea)
    m.engine.wait(ea.d2h_event)
    m.reap()
    m.copy_h2d(ea)  # H2D reads a's slab (slowly) ...
    m.release_host(ea)  # ... the slab goes back to the pool; it waits for that copy first
    assert m.copy_d2h(eb)  # ... and b's D2H reuses the slab, after a's H2D
    assert eb.host is not None
    m.page_in_inputs([a])
    m.wait_all()
    assert torch.equal(a, torch.full((128,), 1.0))
    m.engine.wait(eb.d2h_event)
    assert torch.equal(eb.host[:512].view(torch.float32), b)
    m.clear()


def test_storage_dying_with_a_copy_in_flight_is_forgotten_on_the_compute_thread() -> None:
    m = _manager(delay_s=0.03)
    t = torch.ones(256)
    entry = m.bind(0, t.untyped_storage())
    assert m.copy_d2h(entry) and m.release_device(entry)
    del t, entry
    gc.collect()
    assert 0 in m.entries  # the copy keeps it alive until it is done and polled
    m.wait_all()
    gc.collect()
    assert m.entries == {} and m.pool.in_use_bytes == 0 and m.offloaded_bytes == 0
    m.clear()


@pytest.mark.parametrize("delay_s", [0.0, 0.02])
def test_verify_catches_a_corrupted_host_slab(delay_s: float) -> None:
    m = _manager(delay_s=delay_s, verify=True)
    m.describe_op = lambda: "before op 7 (aten.mul.Tensor)"
    t = torch.arange(100, dtype=torch.float32)
    entry = m.bind(3, t.untyped_storage(), producer_op=2)
    assert m.copy_d2h(entry) and m.release_device(entry)
    m.engine.wait(entry.d2h_event)
    m.reap()
    assert entry.host is not None
    entry.host[10] ^= 0xFF
    with pytest.raises(HostCopyCorruptedError, match=r"storage 3 .*produced by op 2.*before op 7 \(aten.mul"):
        m.page_in_inputs([t])
    m.clear()


def test_verify_passes_clean_round_trips() -> None:
    m = _manager(verify=True)
    t = torch.randn(1000)
    expected = t.clone()
    entry = m.bind(0, t.untyped_storage())
    for _ in range(2):
        assert m.copy_d2h(entry) and m.release_device(entry)
        m.copy_h2d(entry)
        m.page_in_inputs([t])
    assert torch.equal(t, expected)
    m.clear()
    time.sleep(0)
