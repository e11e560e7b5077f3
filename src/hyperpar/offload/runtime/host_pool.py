"""Host slabs for offloaded activations: carved from a few arenas, reused, bounded, capped.

Sizes drift when sequence lengths or batch sizes do, so a free list per exact size would
keep every size ever seen. Instead each slab (its size aligned to 512 bytes) is carved,
best fit, from the free ranges of a few arenas, and a released slab merges with its free
neighbours: a step whose sizes are new fits in memory an earlier step freed. Within a
step the pool grows by arenas of half the bytes in use (1 to 64 MiB, or the slab's size),
reaching the step's need in a few allocations. Between steps (``new_step``) it is fitted
to the largest step peak of the last ``window_steps`` steps: after a step that grew it,
its arenas are replaced by one arena of the same total (contiguous room where the step
found scattered pieces); above twice that peak, by one of 1.25 times it. So held bytes
stay within about twice the largest recent need whatever the mix of sizes, and
allocations stop once the sizes repeat. Pinned arenas are powers of two (the pinned
allocator rounds every request up to one; a layout uses at most two).

A released slab keeps the event of its last copy; its range merges with a neighbour only
once that copy is done, so a carved slab comes back with the one event its next copy
must follow (None when idle). The carving is the same on both paths: only the arena
allocator differs, and tests inject a plain one to exercise the pinned path on CPU.
"""

from __future__ import annotations

import functools
import logging
from bisect import bisect_left, insort
from collections import deque
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import _disable_current_modes

from hyperpar.offload.runtime.huge_pages import huge_page_bytes
from hyperpar.offload.runtime.normal_tensors import made_outside_inference_mode

logger = logging.getLogger(__name__)
# ``Tensor.data_ptr`` unwrapped: during a step the session wraps it to guard reads of
# activations' bytes (``capture.mode.host_reads``), ~5 µs a call that a host slab never needs
# (measured: 0.9 ms of each HF Llama warmup step at 50 %, two calls per storage moved)
_data_ptr = torch._C.TensorBase.data_ptr

ALIGN_BYTES = 512
MIN_ARENA_BYTES = 1 << 20
ARENA_BYTES = 64 << 20  # largest growth step within a step (a larger slab: its own size)
WINDOW_STEPS = 256  # steps whose largest peak the pool is fitted to
TRIM_FACTOR = 2.0  # held bytes above this times that peak are given back between steps ...
KEEP_FACTOR = 1.5  # ... down to this times it


def aligned(nbytes: int) -> int:
    return (nbytes + ALIGN_BYTES - 1) // ALIGN_BYTES * ALIGN_BYTES


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _powers_of_two(total: int, smallest: int) -> list[int]:
    """``total``'s powers of two from the largest down to ``smallest`` (at most four): pinned
    arenas that together hold no more than ``total``."""
    out: list[int] = []
    while total >= smallest and len(out) < 4:
        piece = 1 << (total.bit_length() - 1)
        out.append(piece)
        total -= piece
    return out


def _done(event: Any) -> bool:
    """An event without ``query`` (a test marker) is never assumed complete."""
    if event is None:
        return True
    query = getattr(event, "query", None)
    return bool(query()) if query is not None else False


def _outside_any_mode(make: Callable[[int], torch.Tensor]) -> Callable[[int], torch.Tensor]:
    """Host memory is never a step's activation: an arena made while a step's dispatch mode is
    on outside its handlers (an unpack hook paging a copy in after a fast step fell back) must
    not be traced, or the session guards its bytes against the disk tier's I/O thread."""
    @functools.wraps(make)
    def wrapper(nbytes: int) -> torch.Tensor:
        with _disable_current_modes():
            return make(nbytes)
    return wrapper


def _plain_arena(nbytes: int) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8)


def _aligned_arena(align: int, nbytes: int) -> torch.Tensor:
    """Plain bytes starting at an ``align`` boundary: with every slab a multiple of ``align``,
    every slab starts on one too (the disk tier's direct I/O then moves slabs in place), on
    huge pages where the OS gives them (``runtime.huge_pages``: direct I/O of 4 KiB pages took
    twice the time)."""
    return huge_page_bytes(nbytes, align)


def _pinned_arena(nbytes: int) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


class _Arena:
    __slots__ = ("aid", "buffer", "lent", "size")

    def __init__(self, aid: int, buffer: torch.Tensor) -> None:
        self.aid = aid
        self.buffer = buffer
        self.size = buffer.numel()
        self.lent = 0  # slabs carved from it and not yet released


class HostPool:
    """``acquire`` returns None at the cap: the caller keeps the storage on the device.

    ``arena_allocator(nbytes) -> uint8 tensor`` replaces the default (``torch.empty``,
    pinned when ``pin_memory``); ``pin_memory`` still selects the power-of-two arenas.
    """

    def __init__(self, cap_bytes: int, pin_memory: bool = False, *,
                 arena_allocator: Callable[[int], torch.Tensor] | None = None,
                 window_steps: int = WINDOW_STEPS, align: int = ALIGN_BYTES) -> None:
        if isinstance(cap_bytes, bool) or not isinstance(cap_bytes, int) or cap_bytes < 0:
            raise ValueError(f"cap_bytes must be a non-negative int, got {cap_bytes!r}")
        if isinstance(window_steps, bool) or not isinstance(window_steps, int) or window_steps < 1:
            raise ValueError(f"window_steps must be a positive int, got {window_steps!r}")
        if (isinstance(align, bool) or not isinstance(align, int) or align < ALIGN_BYTES
                or align & (align - 1)):
            raise ValueError(f"align must be a power of two >= {ALIGN_BYTES}, got {align!r}")
        self.cap_bytes = cap_bytes
        self.pin_memory = pin_memory
        self.align = align
        plain = _plain_arena if align <= ALIGN_BYTES else functools.partial(_aligned_arena, align)
        self._allocate_arena = _outside_any_mode(made_outside_inference_mode(
            arena_allocator or (_pinned_arena if pin_memory else plain)))
        self.in_use_bytes = 0
        self.cap_hits = 0
        self.allocations = 0  # new host allocations (arenas), ever
        self._held = 0
        self._arenas: dict[int, _Arena] = {}
        self._next_aid = 0
        # free ranges, by (arena, start) -> (end, event), by (arena, end) -> start, and
        # sorted by (length, arena, start) for best fit
        self._free: dict[tuple[int, int], tuple[int, Any]] = {}
        self._free_end: dict[tuple[int, int], int] = {}
        self._by_length: list[tuple[int, int, int]] = []
        self._lent: dict[int, tuple[int, int, int]] = {}  # slab data_ptr -> (arena, start, end)
        self._pending = 0  # free ranges that still carry an event
        self._step_peak = 0
        self.step_peak_held_bytes = 0  # the most arena bytes held at once since the step began
        self._recent_peaks: deque[int] = deque(maxlen=window_steps)
        self._grew = False  # an arena was added since the last step began
        self._warned_cap = False

    def aligned(self, nbytes: int) -> int:
        """The size of the slab ``nbytes`` get: a multiple of ``align``."""
        return -(-nbytes // self.align) * self.align

    @property
    def held_bytes(self) -> int:
        """Host bytes this pool holds: every arena, whether carved or free."""
        return self._held

    @property
    def cached_bytes(self) -> int:
        """Held bytes not lent out: free for reuse."""
        return self._held - self.in_use_bytes

    @property
    def arena_sizes(self) -> list[int]:
        """Bytes of each arena, largest first."""
        return sorted((a.size for a in self._arenas.values()), reverse=True)

    def acquire(self, nbytes: int) -> torch.Tensor | None:
        got = self.acquire_with_event(nbytes)
        return None if got is None else got[0]

    def acquire_with_event(self, nbytes: int, past_cap: bool = False) -> tuple[torch.Tensor, Any] | None:
        """A slab of ``aligned(nbytes)`` and the event of the last copy that used its memory
        (None when idle), or None at the cap (``past_cap``: an arena past it instead, for bytes
        that have nowhere else to go)."""
        size = self.aligned(max(nbytes, 1))
        found = self._best_fit(size)
        if found is None and self._pending:
            self._settle()
            found = self._best_fit(size)
        if found is None and self._grow(size):
            found = self._best_fit(size)
        if found is None and past_cap:
            self._new_arena(_next_pow2(size) if self.pin_memory else size)
            self._grew = True
            found = self._best_fit(size)
        if found is None:
            self.cap_hits += 1
            if not self._warned_cap:
                self._warned_cap = True
                logger.warning("host pool cap of %d bytes reached (%d in use, %d requested): "
                               "storages stay on the device", self.cap_bytes, self.in_use_bytes, size)
            return None
        aid, start, event = found
        arena = self._arenas[aid]
        slab = arena.buffer[start:start + size]
        self._lent[_data_ptr(slab)] = (aid, start, start + size)
        arena.lent += 1
        self.in_use_bytes += size
        if self.in_use_bytes > self._step_peak:
            self._step_peak = self.in_use_bytes
        return slab, event

    def release(self, slab: torch.Tensor, event: Any = None) -> None:
        """Give a slab back with the event of the last copy that used it (None: none in flight)."""
        where = self._lent.pop(_data_ptr(slab), None)
        if where is None:
            raise ValueError(f"release: this slab ({slab.numel()} bytes at {slab.data_ptr():#x}) "
                             f"is not lent by this pool")
        aid, start, end = where
        self._arenas[aid].lent -= 1
        self.in_use_bytes -= end - start
        self._add_free(aid, start, end, event)

    def new_step(self) -> None:
        """Between steps: the last step's peak joins the window and the arenas are fitted to
        the window (see the module doc); the cap warning is logged once per step."""
        self._warned_cap = False
        self._recent_peaks.append(self._step_peak)
        self._step_peak = self.in_use_bytes
        if self._pending:
            self._settle()
        self._refit(max(self._recent_peaks))
        self._grew = False
        self.step_peak_held_bytes = self._held

    def trim(self) -> None:
        """Free every arena with nothing lent (after a failed step, or to give memory back)."""
        for arena in [a for a in self._arenas.values() if a.lent == 0]:
            self._drop_arena(arena)
        self._empty_pinned_cache()

    # --- free ranges ----------------------------------------------------------------
    def _best_fit(self, size: int) -> tuple[int, int, Any] | None:
        """Carve ``size`` bytes from the smallest free range that holds them."""
        by_length = self._by_length
        i = bisect_left(by_length, (size, -1, -1))
        if i == len(by_length):
            return None
        length, aid, start = by_length.pop(i)
        end, event = self._remove_free(aid, start, listed=False)
        if length > size:
            self._insert_free(aid, start + size, end, event)
        return aid, start, event

    def _add_free(self, aid: int, start: int, end: int, event: Any) -> None:
        """Insert a range, merged with its free neighbours when no copy still uses either."""
        if _done(event):
            event = None
            # a neighbour freed while its copy ran was not merged with its own neighbours
            free, free_end = self._free, self._free_end
            while (left := free_end.get((aid, start))) is not None and _done(free[(aid, left)][1]):
                self._remove_free(aid, left)
                start = left
            while (right := free.get((aid, end))) is not None and _done(right[1]):
                self._remove_free(aid, end)
                end = right[0]
        self._insert_free(aid, start, end, event)

    def _insert_free(self, aid: int, start: int, end: int, event: Any) -> None:
        self._free[(aid, start)] = (end, event)
        self._free_end[(aid, end)] = start
        insort(self._by_length, (end - start, aid, start))
        if event is not None:
            self._pending += 1

    def _remove_free(self, aid: int, start: int, listed: bool = True) -> tuple[int, Any]:
        end, event = self._free.pop((aid, start))
        del self._free_end[(aid, end)]
        if listed:
            by_length = self._by_length
            del by_length[bisect_left(by_length, (end - start, aid, start))]
        if event is not None:
            self._pending -= 1
        return end, event

    def _settle(self) -> None:
        """Merge the ranges whose last copy has finished since they were freed."""
        for key in [k for k, (_, event) in self._free.items() if event is not None]:
            current = self._free.get(key)  # an earlier merge may have taken it in
            if current is not None and current[1] is not None and _done(current[1]):
                end, _ = self._remove_free(*key)
                self._add_free(key[0], key[1], end, None)

    # --- arenas ---------------------------------------------------------------------
    def _growth_bytes(self, size: int) -> int:
        grow = min(ARENA_BYTES, max(MIN_ARENA_BYTES, self.in_use_bytes // 2))
        if self.pin_memory:
            return max(_next_pow2(size), 1 << (grow.bit_length() - 1))
        return max(size, grow)

    def _layout(self, total: int) -> list[int]:
        """Arena sizes that hold ``total`` bytes: one arena, or when pinned the fewest powers
        of two, at most two (a third more at worst, against twice for one)."""
        if total <= 0:
            return []
        if not self.pin_memory:
            return [total]
        high = 1 << (total.bit_length() - 1)
        if high == total:
            return [high]
        rest = _next_pow2(total - high)
        return [high, rest] if rest < high else [2 * high]

    def _grow(self, size: int) -> bool:
        """Add an arena that holds ``size``; within the cap, freeing idle arenas if need be."""
        room = self.cap_bytes - self._held
        want = self._growth_bytes(size)
        if want > room:
            # the last bit of room under the cap: exact, or pinned the least power of two
            # (what the pinned allocator really takes), so the cap bounds the real bytes
            want = _next_pow2(size) if self.pin_memory else size
        if want > room:
            for arena in sorted((a for a in self._arenas.values() if a.lent == 0), key=lambda a: a.size):
                self._drop_arena(arena)
                if want <= self.cap_bytes - self._held:
                    break
        if want > self.cap_bytes - self._held:
            return False
        self._new_arena(want)
        self._grew = True
        return True

    def _new_arena(self, nbytes: int) -> None:
        buffer = self._allocate_arena(nbytes)
        self.allocations += 1
        arena = _Arena(self._next_aid, buffer)
        self._next_aid += 1
        self._arenas[arena.aid] = arena
        self._held += arena.size
        if self._held > self.step_peak_held_bytes:
            self.step_peak_held_bytes = self._held
        self._insert_free(arena.aid, 0, arena.size, None)

    def _refit(self, need: int) -> None:
        """Between steps: fit the arenas to the window's peak ``need``. Above ``TRIM_FACTOR``
        times it (or the layout of ``KEEP_FACTOR`` times it, if larger) the pool is laid out
        anew at the latter; after a step that grew the pool, its arenas become one layout of
        the same total (contiguous room where the step found only scattered pieces)."""
        if not self._grew and self._held <= TRIM_FACTOR * need:  # the common case: nothing to do
            return
        keep = sum(self._layout(self.aligned(int(KEEP_FACTOR * need))))
        if self._held > max(TRIM_FACTOR * need, keep):
            target = keep
        elif self._grew:
            target = max(self._held, keep)
        else:
            return
        if any(a.lent for a in self._arenas.values()):  # slabs still out: only drop idle arenas
            for arena in sorted((a for a in self._arenas.values() if a.lent == 0), key=lambda a: -a.size):
                if self._held - arena.size >= target:
                    self._drop_arena(arena)
            return
        self._drop_all()
        sizes = self._layout(target)
        if sum(sizes) > self.cap_bytes:  # the cap's bytes at most: one arena, or pinned its powers of two
            top = self.aligned(min(target, self.cap_bytes)) if self.cap_bytes >= self.align else 0
            top = min(top, self.cap_bytes // self.align * self.align)
            sizes = _powers_of_two(top, self.align) if self.pin_memory else [top] if top else []
        for nbytes in sizes:
            self._new_arena(nbytes)

    def _drop_all(self) -> None:
        """Drop every arena (none may be lent) and, when pinned, the allocator's cache of them."""
        self._arenas.clear()
        self._free.clear()
        self._free_end.clear()
        self._by_length.clear()
        self._pending = 0
        self._held = 0
        self._empty_pinned_cache()

    def _drop_arena(self, arena: _Arena) -> None:
        aid = arena.aid
        for key in [k for k in self._free if k[0] == aid]:
            self._remove_free(*key)
        del self._arenas[aid]
        self._held -= arena.size

    def _empty_pinned_cache(self) -> None:
        """Pinned blocks freed here stay cached by torch's host allocator unless emptied."""
        if self.pin_memory and self._allocate_arena is _pinned_arena:
            empty = getattr(torch.accelerator, "empty_host_cache", None)
            if empty is not None and torch.accelerator.is_available():
                empty()
