"""Grouped matrix multiplies over contiguous row groups, one group per local expert.

``torch._grouped_mm`` does all experts in one call (measured faster than a loop of
``mm`` on CPU float32 and bfloat16, see docs/moe.md); it exists only in newer torch,
only for some dtypes and needs 16-byte aligned strides, so every call checks that it
applies and falls back to a loop of ``mm`` otherwise. Both paths give exact zeros for
groups without rows.

A fused call that fails is only ever retried as a loop when the kernel says it does not
support the operands (``NotImplementedError``, or a message saying so), and then only
that operand signature (device, dtype, kind, fixed sizes) stops trying the fused path.
Any other failure, out-of-memory first of all, propagates unchanged.
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)

_GROUPED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_UNSUPPORTED_WORDS = ("not supported", "not implemented", "unsupported", "only supports", "only supported")
_disabled: set[tuple[object, ...]] = set()
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


def _is_unsupported(exc: BaseException) -> bool:
    """A kernel that refuses these operands, as opposed to one that failed running them."""
    if isinstance(exc, torch.OutOfMemoryError):
        return False
    if isinstance(exc, NotImplementedError):
        return True
    text = str(exc).lower()
    return "out of memory" not in text and any(word in text for word in _UNSUPPORTED_WORDS)


def _try_grouped(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor,
                 signature: tuple[object, ...]) -> torch.Tensor | None:
    if _force_loop or not hasattr(torch, "_grouped_mm") or a.dtype not in _GROUPED_DTYPES:
        return None
    key = (a.device.type, a.dtype, *signature)
    if key in _disabled or not (_strides_aligned(a) and _strides_aligned(b)):
        return None
    try:
        return torch._grouped_mm(a, b, offs=offsets)
    except (RuntimeError, NotImplementedError) as exc:
        if not _is_unsupported(exc):
            raise
        _disabled.add(key)
        log.info("torch._grouped_mm does not support %s, using a loop of mm for it: %s", key, exc)
        return None


def grouped_mm(rows: torch.Tensor, weight: torch.Tensor, counts: list[int],
               offsets: torch.Tensor) -> torch.Tensor:
    """``out[group g rows] = rows[group g] @ weight[g]``: rows [R, K], weight [G, K, N] -> [R, N].

    ``counts`` are the rows per group (host ints); ``offsets`` their int32 cumulative sum
    on the rows' device.
    """
    fused = _try_grouped(rows, weight, offsets, ("mm", *weight.shape, *weight.stride()))
    if fused is not None:
        return fused
    out = rows.new_empty(rows.shape[0], weight.shape[2])
    start = 0
    for g, count in enumerate(counts):
        if count:
            torch.mm(rows[start:start + count], weight[g], out=out[start:start + count])
        start += count
    return out


def grouped_mm_cast(rows: torch.Tensor, weight: torch.Tensor, counts: list[int],
                    transpose: bool = False) -> torch.Tensor:
    """``grouped_mm(rows, weight)`` (``weight.transpose(1, 2)`` with ``transpose``) for a weight
    wider than ``rows`` (the ``gemm_dtype`` opt-in): each group's weight is cast into one reused
    buffer right before its ``mm``, instead of casting the whole stack into a fresh tensor per
    call. The values are those of casting first (a cast is element by element); the stack-sized
    copy cost new pages (page faults) every call, the buffer is touched once and stays in cache."""
    width = weight.shape[1] if transpose else weight.shape[2]
    out = rows.new_empty(rows.shape[0], width)
    buffer = torch.empty(weight.shape[1:], dtype=rows.dtype, device=rows.device)
    operand = buffer.t() if transpose else buffer
    start = 0
    for g, count in enumerate(counts):
        if count:
            buffer.copy_(weight[g])
            torch.mm(rows[start:start + count], operand, out=out[start:start + count])
        start += count
    return out


def grouped_weight_grad(rows: torch.Tensor, grad: torch.Tensor, counts: list[int],
                        offsets: torch.Tensor) -> torch.Tensor:
    """``out[g] = rows[group g].T @ grad[group g]``: rows [R, K], grad [R, N] -> [G, K, N]."""
    fused = _try_grouped(rows.t(), grad, offsets, ("weight_grad", len(counts), rows.shape[1], grad.shape[1]))
    if fused is not None:
        return fused
    out = rows.new_zeros(len(counts), rows.shape[1], grad.shape[1])
    start = 0
    for g, count in enumerate(counts):
        if count:
            torch.mm(rows[start:start + count].t(), grad[start:start + count], out=out[g])
        start += count
    return out


def weight_grad_as(dtype: torch.dtype, rows: torch.Tensor, grad: torch.Tensor, counts: list[int],
                   offsets: torch.Tensor, blocks: int = 16) -> torch.Tensor:
    """``grouped_weight_grad`` returned in ``dtype``. Operands narrower than ``dtype`` (the
    ``gemm_dtype`` opt-in) are multiplied a block at a time (about ``1 / blocks`` of it: a few
    groups, or a slice of one group's rows when there are fewer groups than blocks) and each
    block copied into the result, so the narrow result held beside the wide one is a block,
    not a second gradient. More blocks hold less and cost more calls. A group is sliced by the
    result's rows (the columns of ``rows``), so every block lands in a contiguous stretch of
    the result (a copy into a column slice ran at a quarter of the speed), and a one-group
    block is one ``mm`` (a fused call for one group cost more than the call it replaces)."""
    if rows.dtype == dtype:
        return grouped_weight_grad(rows, grad, counts, offsets)
    groups, depth = len(counts), rows.shape[1]
    out = torch.empty(groups, depth, grad.shape[1], dtype=dtype, device=rows.device)
    block = -(-groups // blocks)
    slices = _column_slices(depth, -(-blocks // groups), rows.element_size())
    narrow: torch.Tensor | None = None  # one-group blocks: one reused product buffer, not fresh pages
    start = 0
    for first in range(0, groups, block):
        last = min(groups, first + block)
        size = sum(counts[first:last])
        block_rows, block_grad = rows[start:start + size], grad[start:start + size]
        for part_rows in slices:
            if last - first == 1:
                if size:
                    if narrow is None:
                        narrow = rows.new_empty(max(s.stop - s.start for s in slices), grad.shape[1])
                    product = narrow[:part_rows.stop - part_rows.start]
                    torch.mm(block_rows[:, part_rows].t(), block_grad, out=product)
                    out[first, part_rows].copy_(product)
                else:
                    out[first, part_rows].zero_()
                continue
            part = grouped_weight_grad(block_rows[:, part_rows], block_grad, counts[first:last],
                                       offsets[first:last] - start)
            out[first:last, part_rows].copy_(part)
            del part
        start += size
    return out


def _column_slices(width: int, parts: int, itemsize: int) -> list[slice]:
    """``width`` columns in up to ``parts`` slices whose starts stay 16-byte aligned."""
    step = 16 // itemsize
    size = max(step, -(-width // parts // step) * step)
    return [slice(begin, min(width, begin + size)) for begin in range(0, width, size)]


def group_offsets(counts: list[int], device: torch.device) -> torch.Tensor:
    """The int32 end offset of every group, as ``torch._grouped_mm`` wants them."""
    ends: list[int] = []
    total = 0
    for count in counts:
        total += count
        ends.append(total)
    return torch.tensor(ends, dtype=torch.int32, device=device)
