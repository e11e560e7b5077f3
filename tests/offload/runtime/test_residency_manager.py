from __future__ import annotations

import gc

import numpy as np
import pytest
import torch

from hyperpar.offload.runtime import HostPool, ResidencyManager, SyncCopyEngine
from hyperpar.offload.runtime.residency_manager import LostStorageError


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


def test_release_needs_a_current_host_copy_unless_final() -> None:
    m = _manager()
    t = torch.ones(8)
    entry = m.bind(0, t.untyped_storage())
    assert not m.release_device(entry)  # no host copy: refused
    assert m.copy_d2h(entry)
    m.mark_written(entry)
    assert not m.release_device(entry)  # host copy is stale after a write: refused
    assert m.copy_d2h(entry) and m.bytes_d2h == 64  # copied again
    t2 = torch.ones(8)
    e2 = m.bind(1, t2.untyped_storage())
    assert m.release_device(e2, final=True) and e2.discarded
    with pytest.raises(LostStorageError, match="storage 1"):
        m.copy_h2d(e2)
    assert m.restore_all() == 1 and t2.untyped_storage().nbytes() == 32
    m.copy_d2h(entry)
    assert m.release_device(entry) and entry.offloaded
    m.release_host(entry)  # it is coming back: its only copy is kept
    assert entry.host is not None
    m.copy_h2d(entry)
    t3 = torch.ones(8)
    e3 = m.bind(2, t3.untyped_storage())
    assert m.copy_d2h(e3) and m.release_device(e3, final=True) and not e3.discarded
    m.release_host(e3)  # released after its last access: the host copy goes too
    assert e3.host is None and e3.discarded


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
