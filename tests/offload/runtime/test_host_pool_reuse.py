"""The host pool counts its allocations, reuses exact sizes, hands back each slab's last event."""

from __future__ import annotations

import torch

from hyperpar.offload.runtime import HostPool


def test_allocations_stop_once_sizes_repeat() -> None:
    pool = HostPool(cap_bytes=1 << 20)
    sizes = [1000, 5000, 1000, 70000]
    for step in range(3):
        slabs = [pool.acquire(n) for n in sizes]
        assert all(s is not None for s in slabs)
        for s in slabs:
            assert s is not None
            pool.release(s)
        if step == 0:
            assert pool.allocations == 4
    assert pool.allocations == 4 and pool.in_use_bytes == 0


def test_slab_comes_back_with_the_event_of_its_last_copy() -> None:
    pool = HostPool(cap_bytes=1 << 20)
    got = pool.acquire_with_event(100)
    assert got is not None and got[1] is None
    marker = object()
    pool.release(got[0], marker)
    again = pool.acquire_with_event(100)
    assert again is not None and again[0] is got[0] and again[1] is marker


def test_never_exceeds_its_cap() -> None:
    pool = HostPool(cap_bytes=8192)
    held = []
    for n in [3000, 3000, 3000, 100, 5000]:
        s = pool.acquire(n)
        if s is not None:
            held.append(s)
        assert pool.held_bytes <= 8192
    assert pool.cap_hits >= 1 and len(held) == 3
    assert torch.equal(torch.tensor(pool.held_bytes), torch.tensor(3072 * 2 + 512))
