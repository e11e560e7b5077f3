"""Host slabs for offloaded activations: exact sizes (aligned), reused across steps, capped.

Exact sizes instead of power-of-two buckets: activation sizes repeat step after step, so
reuse by exact size wastes nothing and never lends a huge slab for a tiny request.
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)

ALIGN_BYTES = 512


def aligned(nbytes: int) -> int:
    return (nbytes + ALIGN_BYTES - 1) // ALIGN_BYTES * ALIGN_BYTES


class HostPool:
    """``acquire`` returns None at the cap: the caller keeps the storage on the device."""

    def __init__(self, cap_bytes: int, pin_memory: bool = False) -> None:
        if isinstance(cap_bytes, bool) or not isinstance(cap_bytes, int) or cap_bytes < 0:
            raise ValueError(f"cap_bytes must be a non-negative int, got {cap_bytes!r}")
        self.cap_bytes = cap_bytes
        self.pin_memory = pin_memory
        self._free: dict[int, list[torch.Tensor]] = {}
        self.in_use_bytes = 0
        self.cached_bytes = 0
        self.cap_hits = 0
        self._warned_cap = False

    @property
    def held_bytes(self) -> int:
        return self.in_use_bytes + self.cached_bytes

    def acquire(self, nbytes: int) -> torch.Tensor | None:
        size = aligned(max(nbytes, 1))
        bucket = self._free.get(size)
        if bucket:
            slab = bucket.pop()
            self.cached_bytes -= size
        else:
            if self.in_use_bytes + self.cached_bytes + size > self.cap_bytes:
                self._drop_cached(self.in_use_bytes + self.cached_bytes + size - self.cap_bytes)
            if self.in_use_bytes + size > self.cap_bytes:
                self.cap_hits += 1
                if not self._warned_cap:
                    self._warned_cap = True
                    logger.warning(
                        "host pool cap of %d bytes reached (%d in use, %d requested): "
                        "storages stay on the device", self.cap_bytes, self.in_use_bytes, size,
                    )
                return None
            slab = torch.empty(size, dtype=torch.uint8, pin_memory=self.pin_memory)
        self.in_use_bytes += size
        return slab

    def release(self, slab: torch.Tensor) -> None:
        size = slab.numel()
        self.in_use_bytes -= size
        self._free.setdefault(size, []).append(slab)
        self.cached_bytes += size

    def trim(self) -> None:
        """Free every cached slab (after a failed step, or to give memory back)."""
        self._free.clear()
        self.cached_bytes = 0

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
