"""The host pool counts its allocations, reuses and merges freed ranges, and hands back the
event of the last copy that used a slab's memory."""

from __future__ import annotations

import torch

from hyperpar.offload.runtime import HostPool
from hyperpar.offload.runtime.host_pool import MIN_ARENA_BYTES


class FakeEvent:
    def __init__(self) -> None:
        self.done = False

    def query(self) -> bool:
        return self.done


def test_allocations_stop_once_sizes_repeat() -> None:
    pool = HostPool(cap_bytes=1 << 26)
    sizes = [1000, 5 << 20, 1000, 70000, 3 << 20]
    counts = []
    for _ in range(4):
        pool.new_step()
        slabs = [pool.acquire(n) for n in sizes]
        for s in slabs:
            assert s is not None
            pool.release(s)
        counts.append(pool.allocations)
    assert counts[1:] == [counts[1]] * 3, counts
    assert pool.in_use_bytes == 0 and len(pool.arena_sizes) == 1


def test_slab_comes_back_with_the_event_of_its_last_copy() -> None:
    pool = HostPool(cap_bytes=1 << 24)
    got = pool.acquire_with_event(100)
    assert got is not None and got[1] is None
    marker = object()  # no query(): never assumed complete
    pool.release(got[0], marker)
    again = pool.acquire_with_event(100)
    assert again is not None and again[0].data_ptr() == got[0].data_ptr() and again[1] is marker


def test_freed_ranges_merge_once_their_copies_are_done() -> None:
    pool = HostPool(cap_bytes=MIN_ARENA_BYTES)  # one arena, no room to grow
    a, b, c = (pool.acquire(4096) for _ in range(3))
    rest = pool.acquire(MIN_ARENA_BYTES - 3 * 4096)
    assert a is not None and b is not None and c is not None and rest is not None
    assert b.data_ptr() == a.data_ptr() + 4096 and c.data_ptr() == b.data_ptr() + 4096
    pending = FakeEvent()
    pool.release(a)
    pool.release(b, pending)  # a copy still reads b: b may not join its neighbours yet
    pool.release(c)
    assert pool.acquire(8192) is None and pool.cap_hits == 1
    # best fit: a's range (lowest address) with no event, then b's with its event
    got_a, got_b = pool.acquire_with_event(4096), pool.acquire_with_event(4096)
    assert got_a is not None and got_a[0].data_ptr() == a.data_ptr() and got_a[1] is None
    assert got_b is not None and got_b[0].data_ptr() == b.data_ptr() and got_b[1] is pending
    pool.release(got_a[0])
    pool.release(got_b[0], pending)
    pending.done = True  # the copy finished: the three ranges merge when one is needed
    whole = pool.acquire_with_event(3 * 4096)
    assert whole is not None and whole[0].data_ptr() == a.data_ptr() and whole[1] is None
    assert pool.allocations == 1


def test_every_byte_of_an_arena_is_reusable_after_fragmentation() -> None:
    """Many small slabs freed in a scattered order merge back into one range."""
    pool = HostPool(cap_bytes=1 << 24)
    slabs = [pool.acquire(512 * (1 + k % 7)) for k in range(200)]
    order = torch.randperm(200, generator=torch.Generator().manual_seed(0)).tolist()
    for k in order:
        s = slabs[k]
        assert s is not None
        pool.release(s)
    arena = pool.held_bytes
    whole = pool.acquire(arena)
    assert whole is not None and pool.allocations == 1 and pool.held_bytes == arena


def test_never_exceeds_its_cap() -> None:
    pool = HostPool(cap_bytes=8192)
    held = []
    for n in [3000, 3000, 3000, 100, 5000]:
        s = pool.acquire(n)
        if s is not None:
            held.append(s)
        assert pool.held_bytes <= 8192
    assert pool.cap_hits == 2 and len(held) == 3
    assert pool.held_bytes == 3072 * 2 + 512
