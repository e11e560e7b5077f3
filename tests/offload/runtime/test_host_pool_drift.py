"""The host pool under drifting sizes, on the plain and the pinned path (the pinned path's
carving, power-of-two arenas, with plain CPU memory behind them).

Each step draws a shape (batch, sequence length), takes a slab per activation, frees some
mid-step and takes new ones (a host copy gone stale), and frees the rest; a freed slab
carries an event that completes a few pool calls later, and every event is complete
between steps, as in a session. The same shape replays the same calls, as a plan does.
"""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from hyperpar.offload.runtime import HostPool
from hyperpar.offload.runtime.host_pool import MIN_ARENA_BYTES

WIDTHS = (32, 128, 32, 64, 256)  # bytes per token of one layer's offloaded activations
LAYERS = 3


class CountdownEvent:
    """Complete after ``calls`` pool calls; its copy started after ``after`` completed."""

    def __init__(self, calls: int, after: CountdownEvent | None = None) -> None:
        self.remaining = max(calls, after.remaining if after is not None else 0)
        self.after = after

    def query(self) -> bool:
        return self.remaining <= 0

    def implies(self, other: CountdownEvent) -> bool:
        """Waiting on this event also waits for ``other``."""
        e: CountdownEvent | None = self
        while e is not None:
            if e is other:
                return True
            e = e.after
        return False


Held = tuple[torch.Tensor, int, "CountdownEvent | None"]  # slab, byte pattern, event it came with


class Driver:
    """Runs steps on a pool and checks every slab it gets: its bytes are its own (a pattern
    written at acquire is intact at release) and its event is the pending event of every
    earlier slab its memory overlaps (or an event whose copy was ordered after it)."""

    def __init__(self, pool: HostPool) -> None:
        self.pool = pool
        self.events: list[CountdownEvent] = []
        self.freed: list[tuple[int, int, CountdownEvent]] = []  # this step's releases with events
        self.max_need = 0
        self.arena_sizes: list[int] = []

    def _tick(self) -> None:
        for e in self.events:
            e.remaining -= 1

    def _acquire(self, nbytes: int, held: list[Held], tag: int) -> None:
        self._tick()
        got = self.pool.acquire_with_event(nbytes)
        if got is None:
            return
        slab, event = got
        lo, hi = slab.data_ptr(), slab.data_ptr() + slab.numel()
        overlapping = [e for a, b, e in self.freed if a < hi and lo < b]
        for e in overlapping:
            if not e.query():
                assert event is not None and event.implies(e), \
                    "a slab over memory a copy still uses must come with its event"
        assert event is None or any(event is e for e in overlapping), "an event from elsewhere"
        slab.fill_(tag)
        held.append((slab, tag, event))

    def _release(self, slab: torch.Tensor, tag: int, after: CountdownEvent | None,
                 rng: random.Random) -> None:
        self._tick()
        assert bool((slab == tag).all()), "a slab's bytes were overwritten while it was held"
        event = CountdownEvent(rng.randint(0, 5), after)  # the slab's copy waited for ``after``
        self.events.append(event)
        self.freed.append((slab.data_ptr(), slab.data_ptr() + slab.numel(), event))
        self.pool.release(slab, event)

    def step(self, shape: tuple[int, int]) -> None:
        for e in self.events:  # between steps every copy is done
            e.remaining = 0
        self.events.clear()
        self.freed.clear()
        self.pool.new_step()
        rng = random.Random(shape[0] * 1000 + shape[1])
        tokens = shape[0] * shape[1]
        held: list[Held] = []
        tag = 0
        for _ in range(LAYERS):
            for width in WIDTHS:
                tag = tag % 255 + 1
                self._acquire(tokens * width, held, tag)
                if held and rng.random() < 0.25:
                    self._release(*held.pop(rng.randrange(len(held))), rng)
                self.max_need = max(self.max_need, self.pool.in_use_bytes)
        ptrs = sorted((s.data_ptr(), s.data_ptr() + s.numel()) for s, _, _ in held)
        assert all(a[1] <= b[0] for a, b in itertools.pairwise(ptrs)), "held slabs overlap"
        while held:
            self._release(*held.pop(), rng)


def _pool(path: str, cap: int = 1 << 34, sizes: list[int] | None = None, **kwargs: int) -> HostPool:
    def allocate(nbytes: int) -> torch.Tensor:
        if sizes is not None:
            sizes.append(nbytes)
        return torch.empty(nbytes, dtype=torch.uint8)

    return HostPool(cap, pin_memory=path == "pinned", arena_allocator=allocate, **kwargs)


def _shape(rng: random.Random) -> tuple[int, int]:
    return rng.randint(1, 8), rng.randint(32, 256)


@pytest.mark.parametrize("path", ["plain", "pinned"])
@pytest.mark.parametrize("seed", [0, 1])
def test_repeating_shapes_bounded_memory_and_allocations_flat(path: str, seed: int) -> None:
    arena_sizes: list[int] = []
    driver = Driver(_pool(path, sizes=arena_sizes))
    rng = random.Random(seed)
    shapes = [_shape(rng) for _ in range(20)]
    allocations = []
    for _ in range(300):
        driver.step(rng.choice(shapes))
        pool = driver.pool
        bound = 2.5 * max(driver.max_need, MIN_ARENA_BYTES)
        assert pool.held_bytes <= bound, (pool.held_bytes, driver.max_need)
        allocations.append(pool.allocations)
    assert allocations[150:] == [allocations[150]] * 150, allocations
    assert allocations[-1] <= 20  # the old exact-size pool: one per slab size ever seen
    if path == "pinned":
        assert all(n & (n - 1) == 0 for n in arena_sizes), arena_sizes


@pytest.mark.parametrize("path", ["plain", "pinned"])
def test_shapes_that_never_repeat_still_bounded(path: str) -> None:
    driver = Driver(_pool(path))
    rng = random.Random(2)
    for _ in range(200):
        driver.step(_shape(rng))
        assert driver.pool.held_bytes <= 2.5 * max(driver.max_need, MIN_ARENA_BYTES)
    assert driver.pool.allocations <= 25


@pytest.mark.parametrize("path", ["plain", "pinned"])
def test_memory_is_given_back_when_recent_steps_need_less(path: str) -> None:
    driver = Driver(_pool(path, window_steps=8))
    rng = random.Random(3)
    for _ in range(30):
        driver.step((8, rng.randint(200, 256)))
    big = driver.pool.held_bytes
    driver.max_need = 0
    for _ in range(8):
        driver.step((1, rng.randint(64, 96)))
    held_after_window = []
    for _ in range(30):
        driver.step((1, rng.randint(64, 96)))
        held_after_window.append(driver.pool.held_bytes)
    small_need = max(driver.max_need, MIN_ARENA_BYTES)
    assert max(held_after_window) <= 2 * small_need < big
    assert len(set(held_after_window)) == 1  # and then flat


@pytest.mark.parametrize("path", ["plain", "pinned"])
def test_at_its_cap_the_pool_says_no_and_counts(path: str) -> None:
    cap = 1 << 20
    driver = Driver(_pool(path, cap=cap))
    rng = random.Random(4)
    for _ in range(40):
        driver.step(_shape(rng))
        assert driver.pool.held_bytes <= cap
    assert driver.pool.cap_hits > 0 and driver.pool.in_use_bytes == 0


def test_between_steps_each_arena_is_one_free_range_again() -> None:
    """Ranges freed while their copy ran merge transitively once it is done."""
    driver = Driver(_pool("plain"))
    rng = random.Random(5)
    for _ in range(60):
        driver.step(_shape(rng))
        for e in driver.events:
            e.remaining = 0
        pool = driver.pool
        pool.new_step()
        allocations = pool.allocations
        whole = [pool.acquire(n) for n in pool.arena_sizes]  # each arena in one piece
        assert pool.allocations == allocations
        for s in whole:
            assert s is not None
            pool.release(s)
