"""Host slabs for offloaded activations: exact sizes (aligned), reused across steps, capped.

Exact sizes instead of power-of-two buckets: activation sizes repeat step after step, so
reuse by exact size wastes nothing and never lends a huge slab for a tiny request. Pinned
slabs are carved from power-of-two arenas (the pinned allocator rounds every request up to
a power of two; carving keeps a 300 MiB slab from costing 512 MiB). A slab comes back with
the event of the last copy that used it, so its next copy can be ordered after that one.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

logger = logging.getLogger(__name__)

ALIGN_BYTES = 512
ARENA_BYTES = 64 << 20


def aligned(nbytes: int) -> int:
    return (nbytes + ALIGN_BYTES - 1) // ALIGN_BYTES * ALIGN_BYTES


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


class HostPool:
    """``acquire`` returns None at the cap: the caller keeps the storage on the device."""

    def __init__(self, cap_bytes: int, pin_memory: bool = False) -> None:
        if isinstance(cap_bytes, bool) or not isinstance(cap_bytes, int) or cap_bytes < 0:
            raise ValueError(f"cap_bytes must be a non-negative int, got {cap_bytes!r}")
        self.cap_bytes = cap_bytes
        self.pin_memory = pin_memory
        self._free: dict[int, list[tuple[torch.Tensor, Any]]] = {}
        self.in_use_bytes = 0
        self.cached_bytes = 0
        self.cap_hits = 0
        self.allocations = 0  # new host allocations (slabs, or arenas when pinned), ever
        self._arenas: list[torch.Tensor] = []
        self._arena_used = 0  # bytes carved from the newest arena
        self._warned_cap = False

    @property
    def held_bytes(self) -> int:
        """Host bytes this pool holds: arenas when pinned, else slabs in use or cached."""
        if self.pin_memory:
            return sum(a.numel() for a in self._arenas)
        return self.in_use_bytes + self.cached_bytes

    def acquire(self, nbytes: int) -> torch.Tensor | None:
        got = self.acquire_with_event(nbytes)
        return None if got is None else got[0]

    def acquire_with_event(self, nbytes: int) -> tuple[torch.Tensor, Any] | None:
        """A slab of at least ``nbytes`` and the event of its last copy (None when idle)."""
        size = aligned(max(nbytes, 1))
        bucket = self._free.get(size)
        if bucket:
            slab, event = bucket.pop()
            self.cached_bytes -= size
            self.in_use_bytes += size
            return slab, event
        slab = self._carve(size) if self.pin_memory else self._allocate(size)
        if slab is None:
            self.cap_hits += 1
            if not self._warned_cap:
                self._warned_cap = True
                logger.warning("host pool cap of %d bytes reached (%d in use, %d requested): "
                               "storages stay on the device", self.cap_bytes, self.in_use_bytes, size)
            return None
        self.in_use_bytes += size
        return slab, None

    def release(self, slab: torch.Tensor, event: Any = None) -> None:
        size = slab.numel()
        self.in_use_bytes -= size
        self._free.setdefault(size, []).append((slab, event))
        self.cached_bytes += size

    def new_step(self) -> None:
        """The cap warning is logged once per step."""
        self._warned_cap = False

    def trim(self) -> None:
        """Free every cached slab (after a failed step, or to give memory back)."""
        self._free.clear()
        self.cached_bytes = 0
        if self.in_use_bytes == 0:
            self._arenas.clear()
            self._arena_used = 0

    # --- allocation -----------------------------------------------------------------
    def _allocate(self, size: int) -> torch.Tensor | None:
        if self.in_use_bytes + self.cached_bytes + size > self.cap_bytes:
            self._drop_cached(self.in_use_bytes + self.cached_bytes + size - self.cap_bytes)
        if self.in_use_bytes + self.cached_bytes + size > self.cap_bytes:
            return None
        self.allocations += 1
        return torch.empty(size, dtype=torch.uint8)

    def _carve(self, size: int) -> torch.Tensor | None:
        arena = self._arenas[-1] if self._arenas else None
        if arena is None or arena.numel() - self._arena_used < size:
            reserved = sum(a.numel() for a in self._arenas)
            want = max(ARENA_BYTES, _next_pow2(size))
            if reserved + want > self.cap_bytes:
                want = size  # the last bit of room under the cap: exact, whatever it costs
                if reserved + want > self.cap_bytes:
                    return None
            self.allocations += 1
            arena = torch.empty(want, dtype=torch.uint8, pin_memory=True)
            self._arenas.append(arena)
            self._arena_used = 0
        slab = arena[self._arena_used: self._arena_used + size]
        self._arena_used += size
        return slab

    def _drop_cached(self, need: int) -> None:
        for size in sorted(self._free, reverse=True):
            bucket = self._free[size]
            while bucket and need > 0:
                bucket.pop()
                self.cached_bytes -= size
                need -= size
            if need <= 0:
                break
        self._free = {s: b for s, b in self._free.items() if b}
