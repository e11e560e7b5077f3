from __future__ import annotations

import gc

import numpy as np
import torch

from hyperpar.offload.runtime import HostPool, ResidencyManager, SyncCopyEngine


def _manager(cap: int = 1 << 20) -> ResidencyManager:
    return ResidencyManager(torch.device("cpu"), HostPool(cap), SyncCopyEngine())


def test_round_trip_keeps_data_views_identity_and_version() -> None:
    m = _manager()
    t = torch.arange(12, dtype=torch.float32)
    view = t.view(3, 4).t()
    expected = t.clone()
    version = t._version
    entry = m.bind(0, t.untyped_storage())
    assert m.resident_bytes == 48
    assert m.copy_d2h(entry) and m.release_device(entry)
    assert t.untyped_storage().nbytes() == 0  # the device memory is really gone
    assert m.resident_bytes == 0 and m.offloaded_bytes == 48 and m.bytes_d2h == 48
    m.page_in_inputs([view])
    assert m.demand_faults == 1 and entry.resident and m.resident_bytes == 48
    assert torch.equal(t, expected) and torch.equal(view, expected.view(3, 4).t())
    assert t._version == version


def test_release_needs_a_current_host_copy_even_when_final() -> None:
    m = _manager()
    t = torch.ones(8)
    entry = m.bind(0, t.untyped_storage())
    assert not m.release_device(entry)  # no host copy: refused
    assert not m.release_device(entry, final=True)  # not even after the planned last access
    assert m.copy_d2h(entry)
    m.mark_written(entry)
    assert not m.release_device(entry)  # host copy is stale after a write: refused
    assert m.copy_d2h(entry) and m.bytes_d2h == 64  # copied again
    assert m.release_device(entry) and entry.offloaded and m.offloaded_bytes == 32
    m.release_host(entry)  # it is coming back: its only copy is kept
    assert entry.host is not None
    m.copy_h2d(entry)
    assert torch.equal(t, torch.ones(8)) and m.offloaded_bytes == 0
    t3 = torch.full((8,), 3.0)
    e3 = m.bind(2, t3.untyped_storage())
    assert m.copy_d2h(e3) and m.release_device(e3, final=True)
    assert not e3.offloaded and m.offloaded_bytes == 0  # past its lifetime: not counted as offloaded
    m.release_host(e3)  # the copy stays until the storage dies: the user may still hold it
    m.restore_all()
    assert torch.equal(t3, torch.full((8,), 3.0))
    del t3
    assert 2 not in m.entries and m.pool.in_use_bytes == 512


def test_death_is_observed_and_host_slabs_return_to_the_pool() -> None:
    m = _manager()
    t = torch.ones(256)
    entry = m.bind(0, t.untyped_storage())
    assert m.copy_d2h(entry) and m.release_device(entry)
    assert m.pool.in_use_bytes == 1024
    del t, entry
    gc.collect()
    assert m.entries == {} and m.evicted == {} and m.pool.in_use_bytes == 0
    assert m.resident_bytes == 0 and m.offloaded_bytes == 0


def test_cap_and_non_resizable_storages_stay_on_device() -> None:
    m = _manager(cap=0)
    t = torch.ones(8)
    entry = m.bind(0, t.untyped_storage())
    assert not m.copy_d2h(entry) and m.cap_hits == 1 and not m.release_device(entry)
    m2 = _manager()
    external = torch.from_numpy(np.ones(8, dtype=np.float32))
    e2 = m2.bind(0, external.untyped_storage())
    assert m2.copy_d2h(e2) and not m2.release_device(e2)
    assert not e2.evictable and torch.equal(external, torch.ones(8))


def test_clear_returns_everything() -> None:
    m = _manager()
    keep = [torch.ones(64) for _ in range(3)]
    for i, t in enumerate(keep):
        e = m.bind(i, t.untyped_storage())
        m.copy_d2h(e)
        m.release_device(e)
    m.restore_all()
    m.clear()
    assert m.entries == {} and m.pool.in_use_bytes == 0 and all(torch.equal(t, torch.ones(64)) for t in keep)
