from __future__ import annotations

import pytest

from hyperpar.offload.runtime import HostPool
from hyperpar.offload.runtime.host_pool import ALIGN_BYTES


def test_exact_aligned_sizes_are_reused() -> None:
    pool = HostPool(cap_bytes=1 << 20)
    a = pool.acquire(1000)
    assert a is not None and a.numel() == 1024 and pool.in_use_bytes == 1024
    pool.release(a)
    assert pool.in_use_bytes == 0 and pool.cached_bytes == 1024
    b = pool.acquire(1001)  # same aligned size: the same slab comes back
    assert b is not None and b.data_ptr() == a.data_ptr() and pool.cached_bytes == 0
    c = pool.acquire(10)
    assert c is not None and c.numel() == ALIGN_BYTES  # a tiny request gets a tiny slab


def test_cap_returns_none_and_counts_then_drops_cached_slabs_to_fit() -> None:
    pool = HostPool(cap_bytes=4096)
    a = pool.acquire(3000)
    assert a is not None
    assert pool.acquire(2000) is None and pool.cap_hits == 1
    pool.release(a)
    b = pool.acquire(2000)  # the cached 3 KiB slab is dropped to make room
    assert b is not None and pool.held_bytes == 2048
    pool.release(b)
    pool.trim()
    assert pool.held_bytes == 0


def test_bad_cap() -> None:
    with pytest.raises(ValueError, match="cap_bytes"):
        HostPool(cap_bytes=-1)
