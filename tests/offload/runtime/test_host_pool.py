from __future__ import annotations

import pytest
import torch

from hyperpar.offload.runtime import HostPool
from hyperpar.offload.runtime.host_pool import ALIGN_BYTES, MIN_ARENA_BYTES


def test_aligned_slabs_are_carved_and_the_same_memory_comes_back() -> None:
    pool = HostPool(cap_bytes=1 << 24)
    a = pool.acquire(1000)
    assert a is not None and a.numel() == 1024 and pool.in_use_bytes == 1024
    assert pool.held_bytes == MIN_ARENA_BYTES and pool.cached_bytes == MIN_ARENA_BYTES - 1024
    pool.release(a)
    assert pool.in_use_bytes == 0 and pool.cached_bytes == pool.held_bytes
    b = pool.acquire(1001)  # same aligned size: the same memory comes back
    assert b is not None and b.data_ptr() == a.data_ptr() and b.numel() == 1024
    c = pool.acquire(10)
    assert c is not None and c.numel() == ALIGN_BYTES  # a tiny request gets a tiny slab
    assert pool.allocations == 1


def test_cap_returns_none_and_counts_then_reuses_freed_room() -> None:
    pool = HostPool(cap_bytes=4096)
    a = pool.acquire(3000)
    assert a is not None and pool.held_bytes == 3072  # under a small cap: exact arenas
    assert pool.acquire(2000) is None and pool.cap_hits == 1
    assert pool.acquire_with_event(2000) is None and pool.cap_hits == 2
    pool.release(a)
    b = pool.acquire(2000)  # carved from the freed 3 KiB: no new allocation
    assert b is not None and pool.allocations == 1 and pool.held_bytes <= 4096
    big = pool.acquire(4000)  # needs the whole cap: the idle part cannot serve, b is lent
    assert big is None and pool.cap_hits == 3
    pool.release(b)
    big = pool.acquire(4000)  # the idle arena is dropped to make room for one that fits
    assert big is not None and pool.held_bytes == 4096 and pool.allocations == 2
    pool.release(big)
    pool.trim()
    assert pool.held_bytes == 0 and pool.arena_sizes == []


def test_release_of_a_foreign_slab_is_refused_by_name() -> None:
    pool = HostPool(cap_bytes=1 << 24)
    slab = pool.acquire(100)
    assert slab is not None
    with pytest.raises(ValueError, match="not lent by this pool"):
        pool.release(torch.empty(512, dtype=torch.uint8))
    pool.release(slab)
    with pytest.raises(ValueError, match="not lent by this pool"):
        pool.release(slab)  # twice


@pytest.mark.parametrize("kwargs", [{"cap_bytes": -1}, {"cap_bytes": 1.5}, {"cap_bytes": True},
                                    {"cap_bytes": 1, "window_steps": 0}])
def test_bad_arguments(kwargs: dict) -> None:
    with pytest.raises(ValueError, match=next(iter(k for k in ("window_steps", "cap_bytes") if k in kwargs))):
        HostPool(**kwargs)


def _plain(nbytes: int) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8)


def test_a_pinned_pool_under_a_cap_holds_powers_of_two_that_fit_it() -> None:
    """The pinned allocator rounds each block up to a power of two: under a cap that is not
    one (a disk tier's host budget), every arena must be one already, or the real pinned bytes
    would pass the cap (up to twice it)."""
    cap = 26 << 20  # 26 MiB: between 16 and 32
    pool = HostPool(cap, pin_memory=True, arena_allocator=_plain, align=4096)
    for step in range(4):
        slabs = [pool.acquire(3 << 20) for _ in range(8)]  # 24 MiB in 3 MiB slabs
        got = [s for s in slabs if s is not None]
        assert sum(s.numel() for s in got) <= cap
        for size in pool.arena_sizes:
            assert size & (size - 1) == 0, f"step {step}: a pinned arena of {size} bytes is no power of two"
        assert pool.held_bytes <= cap and pool.step_peak_held_bytes <= cap
        for s in got:
            pool.release(s)
        pool.new_step()
        assert all(size & (size - 1) == 0 for size in pool.arena_sizes) and pool.held_bytes <= cap


def test_an_aligned_pool_carves_page_aligned_slabs() -> None:
    pool = HostPool(1 << 24, align=4096)
    slabs = [pool.acquire(n) for n in (1, 5000, 4096, 70000)]
    for s in slabs:
        assert s is not None and s.data_ptr() % 4096 == 0 and s.numel() % 4096 == 0
    with pytest.raises(ValueError, match="align"):
        HostPool(1 << 20, align=1000)
