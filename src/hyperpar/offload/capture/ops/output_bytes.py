"""Exact bytes an op is about to allocate, for the ops whose output size the arguments give.

The online path makes room for an op's output before it runs. For most ops it budgets the
most that op made per input byte so far (at first, as much as it reads), which is wrong the
first time an op makes much more than it reads: a widening cast (autocast, ``logits.float()``:
twice the bytes), a matrix multiply whose output outgrows its operands (an LM head: logits
of the vocabulary's width), a factory op (``zeros``, ``full``: no tensor input at all). Those
outputs are usually the step's largest, and the output was on the device before the next op
could evict anything: a warmup of HF GPT-2 under autocast ran 1.10x its budget at the fp32
upcast of its logits. For these ops the size is known from the arguments, so it is computed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

Tensor = torch.Tensor
Predictor = Callable[[tuple[Any, ...], dict[str, Any], torch.device], int | None]


def _itemsize(dtype: torch.dtype | None, default: torch.dtype) -> int:
    return (dtype or default).itemsize


def _numel(size: Sequence[int]) -> int:
    total = 1
    for n in size:
        total *= int(n)
    return total


def _on(device: Any, here: torch.device) -> bool:
    """Whether ``device`` (an argument: a name, a device, None for the default) is ``here``."""
    where = torch.device(device) if device is not None else torch.get_default_device()
    if where.type != here.type:
        return False
    return where.index is None or here.index is None or where.index == here.index


def _to_copy(args: tuple[Any, ...], kwargs: dict[str, Any], here: torch.device) -> int | None:
    x = args[0]
    if not isinstance(x, Tensor) or x.layout is not torch.strided:
        return None
    device = kwargs.get("device")
    if not _on(device if device is not None else x.device, here):
        return 0  # the copy lands on another device (``.cpu()``): nothing made here
    return x.numel() * _itemsize(kwargs.get("dtype"), x.dtype)


def _matmul(first: int, second: int) -> Predictor:
    """``mm``-like: the result has ``args[first]``'s rows (and batch) and dtype, ``args[second]``'s
    columns."""
    def predict(args: tuple[Any, ...], kwargs: dict[str, Any], here: torch.device) -> int | None:
        a, b = args[first], args[second]
        if not (isinstance(a, Tensor) and isinstance(b, Tensor)):
            return None
        return _numel(a.shape[:-1]) * b.shape[-1] * a.dtype.itemsize
    return predict


def _same_shape(args: tuple[Any, ...], kwargs: dict[str, Any], here: torch.device) -> int | None:
    """A binary pointwise op on two tensors of one shape and dtype makes one more of them;
    anything else (broadcasting, promotion, a scalar) is left to what the op made before.
    Without this, one broadcasting call (HF Llama's rotary ``inv_freq[:, None] * pos[None]``:
    13x its inputs) taught ``mul`` to expect 13x from every call, and warmup evicted 1.7x the
    bytes it needed (HF Llama at 50 %: 2.39 MB out for a 1.37 MB budget, peak 0.99 MB)."""
    a, b = args[0], args[1]
    if type(a) is Tensor and type(b) is Tensor and a.dtype is b.dtype and a.shape == b.shape:
        return a.nbytes
    return None


def _fill_dtype(value: Any) -> torch.dtype:
    """``torch.full``'s dtype without one given: the fill value's kind decides."""
    if isinstance(value, bool):
        return torch.bool
    if isinstance(value, int):
        return torch.int64
    if isinstance(value, complex):
        return torch.complex64 if torch.get_default_dtype() != torch.float64 else torch.complex128
    return torch.get_default_dtype()


def _factory(size_arg: int, like: bool, filled: bool = False) -> Predictor:
    """``zeros(size)`` and the like (``like``: ``x.new_zeros(size)``, the dtype and device ``x``'s;
    ``filled``: ``full(size, value)``, whose dtype follows the value)."""
    def predict(args: tuple[Any, ...], kwargs: dict[str, Any], here: torch.device) -> int | None:
        device = kwargs.get("device")
        if not _on(args[0].device if like and device is None else device, here):
            return 0
        if like:
            default = args[0].dtype
        else:
            default = _fill_dtype(args[size_arg + 1]) if filled else torch.get_default_dtype()
        return _numel(args[size_arg]) * _itemsize(kwargs.get("dtype"), default)
    return predict


def _predictors() -> dict[Any, Predictor]:
    aten = torch.ops.aten
    return {
        aten._to_copy.default: _to_copy,
        aten.mm.default: _matmul(0, 1),
        aten.addmm.default: _matmul(1, 2),
        aten.bmm.default: _matmul(0, 1),
        aten.baddbmm.default: _matmul(1, 2),
        aten.mul.Tensor: _same_shape,
        aten.add.Tensor: _same_shape,
        aten.sub.Tensor: _same_shape,
        aten.div.Tensor: _same_shape,
        aten.zeros.default: _factory(0, like=False),
        aten.ones.default: _factory(0, like=False),
        aten.full.default: _factory(0, like=False, filled=True),
        aten.empty.memory_format: _factory(0, like=False),
        aten.randn.default: _factory(0, like=False),
        aten.rand.default: _factory(0, like=False),
        aten.new_zeros.default: _factory(1, like=True),
        aten.new_ones.default: _factory(1, like=True),
        aten.new_empty.default: _factory(1, like=True),
        aten.new_full.default: _factory(1, like=True),
    }


PREDICTORS: dict[Any, Predictor] = _predictors()
# What a predictor raises for arguments it does not understand (``predict_or_none``; warmup's
# fused path catches them itself, one frame less on every predicted op).
PREDICT_ERRORS = (TypeError, ValueError, IndexError, AttributeError, RuntimeError)


def predicted_bytes(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
                    here: torch.device) -> int | None:
    """Bytes ``func(*args, **kwargs)`` allocates on ``here``, where the arguments say; else None."""
    predict = PREDICTORS.get(func)
    return None if predict is None else predict_or_none(predict, args, kwargs, here)


def predict_or_none(predict: Predictor, args: tuple[Any, ...], kwargs: dict[str, Any],
                    here: torch.device) -> int | None:
    """A predictor's answer, or None for arguments it does not understand (symbolic sizes, an
    unexpected overload's layout): the caller falls back to what the op made before."""
    try:
        return predict(args, kwargs, here)
    except PREDICT_ERRORS:
        return None

