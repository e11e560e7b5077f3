"""Bitwise comparison that also holds for NaN and signed zeros (``torch.equal`` does not)."""

from __future__ import annotations

import torch

_INT_OF = {torch.float32: torch.int32, torch.float64: torch.int64, torch.float16: torch.int16,
           torch.bfloat16: torch.int16}


def same_bits(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    as_int = _INT_OF.get(a.dtype)
    if as_int is None:
        return torch.equal(a, b)
    return torch.equal(a.contiguous().view(as_int), b.contiguous().view(as_int))
