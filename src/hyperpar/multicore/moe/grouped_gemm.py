"""Grouped matrix multiplies over contiguous row groups, one group per local expert.

``torch._grouped_mm`` does all experts in one call (measured faster than a loop of
``mm`` on CPU float32 and bfloat16, see docs/moe.md); it exists only in newer torch,
only for some dtypes and needs 16-byte aligned strides, so every call checks that it
applies and falls back to a loop of ``mm`` otherwise. Both paths give exact zeros for
groups without rows.
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)

_GROUPED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_disabled: set[tuple[str, torch.dtype]] = set()
_force_loop = False


def set_grouped_mm_enabled(enabled: bool) -> None:
    """Switch the fused path off (or back on) process-wide; used to measure both paths."""
    global _force_loop
    _force_loop = not enabled


def _strides_aligned(t: torch.Tensor) -> bool:
    size = t.element_size()
    return all(
        stride == 1 or (stride * size) % 16 == 0 for stride in t.stride()
    ) and t.data_ptr() % 16 == 0


def _grouped_applies(*tensors: torch.Tensor) -> bool:
    if _force_loop or not hasattr(torch, "_grouped_mm"):
        return False
    first = tensors[0]
    if first.dtype not in _GROUPED_DTYPES or (first.device.type, first.dtype) in _disabled:
        return False
    return all(_strides_aligned(t) for t in tensors)


def _try_grouped(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor | None:
    if not _grouped_applies(a, b):
        return None
    try:
        return torch._grouped_mm(a, b, offs=offsets)
    except (RuntimeError, NotImplementedError) as exc:
        _disabled.add((a.device.type, a.dtype))
        log.info("torch._grouped_mm unavailable for %s %s, using a loop of mm: %s",
                 a.device.type, a.dtype, exc)
        return None


def grouped_mm(rows: torch.Tensor, weight: torch.Tensor, counts: list[int],
               offsets: torch.Tensor) -> torch.Tensor:
    """``out[group g rows] = rows[group g] @ weight[g]``: rows [R, K], weight [G, K, N] -> [R, N].

    ``counts`` are the rows per group (host ints); ``offsets`` their int32 cumulative sum
    on the rows' device.
    """
    fused = _try_grouped(rows, weight, offsets)
    if fused is not None:
        return fused
    out = rows.new_empty(rows.shape[0], weight.shape[2])
    start = 0
    for g, count in enumerate(counts):
        if count:
            torch.mm(rows[start:start + count], weight[g], out=out[start:start + count])
        start += count
    return out


def grouped_weight_grad(rows: torch.Tensor, grad: torch.Tensor, counts: list[int],
                        offsets: torch.Tensor) -> torch.Tensor:
    """``out[g] = rows[group g].T @ grad[group g]``: rows [R, K], grad [R, N] -> [G, K, N]."""
    fused = _try_grouped(rows.t(), grad, offsets)
    if fused is not None:
        return fused
    out = rows.new_zeros(len(counts), rows.shape[1], grad.shape[1])
    start = 0
    for g, count in enumerate(counts):
        if count:
            torch.mm(rows[start:start + count].t(), grad[start:start + count], out=out[g])
        start += count
    return out


def group_offsets(counts: list[int], device: torch.device) -> torch.Tensor:
    """The int32 end offset of every group, as ``torch._grouped_mm`` wants them."""
    ends: list[int] = []
    total = 0
    for count in counts:
        total += count
        ends.append(total)
    return torch.tensor(ends, dtype=torch.int32, device=device)
