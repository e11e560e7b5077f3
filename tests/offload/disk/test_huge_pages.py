"""Buffers that direct I/O moves sit on huge pages where the OS gives them (``runtime.huge_pages``)."""

from __future__ import annotations

import gc
import sys
from pathlib import Path

import pytest
import torch

from hyperpar.offload.runtime.disk_store import ALIGN, aligned_bytes
from hyperpar.offload.runtime.host_pool import HostPool
from hyperpar.offload.runtime.huge_pages import HUGE_PAGE, huge_page_bytes

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _thp_mode() -> str | None:
    """The bracketed mode of transparent huge pages (``always``, ``madvise``, ``never``), or None."""
    if not sys.platform.startswith("linux") or not THP.exists():
        return None
    text = THP.read_text()
    return text[text.index("[") + 1:text.index("]")]


def _huge_kib(tensor: torch.Tensor) -> int:
    """KiB of the mapping that holds ``tensor``'s first byte that are backed by huge pages."""
    ptr, found = tensor.data_ptr(), False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            lo, hi = (int(x, 16) for x in head.split("-"))
            found = lo <= ptr < hi
        elif found and line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    return 0


@pytest.mark.parametrize("nbytes", [1, ALIGN, HUGE_PAGE - 1, HUGE_PAGE, 5 * HUGE_PAGE + 3 * ALIGN])
def test_buffers_are_aligned_and_whole(nbytes: int) -> None:
    out = huge_page_bytes(nbytes, ALIGN)
    assert out.numel() == nbytes and out.dtype == torch.uint8 and out.is_contiguous()
    assert out.data_ptr() % (HUGE_PAGE if nbytes >= HUGE_PAGE else ALIGN) == 0
    out.fill_(7)  # every byte is writable
    assert int(out.sum()) == 7 * nbytes


def test_a_huge_page_buffer_lives_as_long_as_a_view_of_it() -> None:
    view = huge_page_bytes(3 * HUGE_PAGE)[HUGE_PAGE:HUGE_PAGE + 8]
    gc.collect()
    view.fill_(5)
    assert int(view.sum()) == 40


@pytest.mark.skipif(_thp_mode() not in ("always", "madvise"), reason="no transparent huge pages here")
def test_the_disk_tiers_buffers_are_backed_by_huge_pages() -> None:
    """The store's aligned buffers and the pool's page-aligned arenas (the disk tier's) map
    huge pages once touched, however much of the heap earlier tests touched: they are fresh
    mappings that asked for them. (A machine short of free huge pages may still give some
    4 KiB ones: at least one huge page is asked, not all.)"""
    store_buffer = aligned_bytes(8 * HUGE_PAGE)
    store_buffer.fill_(1)
    pool = HostPool(16 * HUGE_PAGE, align=ALIGN)
    slab, _ = pool.acquire_with_event(8 * HUGE_PAGE) or (None, None)
    assert slab is not None
    slab.fill_(1)
    assert _huge_kib(store_buffer) >= HUGE_PAGE // 1024
    assert _huge_kib(slab) >= HUGE_PAGE // 1024
