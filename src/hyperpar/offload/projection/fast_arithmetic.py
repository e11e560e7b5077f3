"""Trace a step with the heavy arithmetic skipped: the ops, sizes and dtypes of the real step.

A GPU projection reads only what a trace records (which ops ran, the storages each touched,
their sizes and dtypes), never the values. Tracing a bf16 model on a CPU runs its matmuls and
attention at well under a GFLOP/s, so ``FastArithmetic`` answers those few heavy ops from
their meta kernels instead: each gets zero-filled tensors with the shape, stride and dtype
the op would have made, on the inputs' device; every other op runs as it is. Zeros keep it
deterministic (a region rebuilt in backward gives the same bytes). The values, the loss and
the gradients under it are meaningless: use it to trace, never to train.

Order with an ``OffloadSession``: enter ``FastArithmetic`` first, outside the session::

    with FastArithmetic(), session:
        model(x).sum().backward()

Torch's dispatch modes form a stack and the mode entered last sees each op first. The
session's mode must see, time and record every op; when it runs the op, the op falls through
to ``FastArithmetic`` below it, which skips the arithmetic. The other order would have this
mode answer ``mm`` with ``empty_strided`` and ``zero_`` that the session records in its place
(and run meta kernels under it): entering it inside a session, or an op reaching it with a
session's mode still below it, raises ``RuntimeError``.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any

import torch
from torch._ops import OpOverload
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from hyperpar.offload.capture.mode.dispatch_mode import current_offload_mode

log = logging.getLogger(__name__)

# The ops whose arithmetic dominates a step (matmuls, attention, convolutions, grouped and
# scaled matmuls), those this torch has.
HEAVY_OP_NAMES = (
    "mm", "bmm", "addmm", "baddbmm", "addbmm", "_grouped_mm", "_scaled_mm",
    "convolution", "convolution_backward",
    "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention_for_cpu_backward",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_efficient_attention_backward",
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_backward",
    "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_cudnn_attention_backward",
    "_flash_attention_forward", "_flash_attention_backward",
    "_efficient_attention_forward", "_efficient_attention_backward",
)

WRONG_ORDER = (
    "FastArithmetic must be entered before (outside) the OffloadSession, "
    "`with FastArithmetic(), session:`: inside it, the session would record the zero-filling "
    "ops in place of the skipped ones"
)


def _heavy_overloads() -> frozenset[OpOverload]:
    """Every overload of ``HEAVY_OP_NAMES`` present here that writes none of its arguments
    (``out=`` variants run as they are)."""
    found = set()
    for name in HEAVY_OP_NAMES:
        packet = getattr(torch.ops.aten, name, None)
        if packet is None:
            continue
        for overload in packet.overloads():
            op = getattr(packet, overload)
            if not op._schema.is_mutable:
                found.add(op)
    return frozenset(found)


HEAVY_OPS = _heavy_overloads()
_no_meta: set[OpOverload] = set()  # ops whose meta run failed: run for real, said once
_DISABLED_DISPATCH = torch._C._disabled_torch_dispatch_impl


def _on_meta(t: Any) -> Any:
    if not isinstance(t, torch.Tensor):
        return t
    if t.layout is not torch.strided:
        raise NotImplementedError(f"a {t.layout} input has no meta stand-in here")
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")


class FastArithmetic(TorchDispatchMode):
    """Answer the heavy ops (``HEAVY_OPS``) with zeros of the right shape, stride and dtype;
    run every other op. ``skipped`` counts the ops answered so, ``skipped_by_op`` per op name."""

    def __init__(self) -> None:
        super().__init__()
        self.skipped = 0
        self.skipped_by_op: Counter[str] = Counter()

    def __enter__(self) -> FastArithmetic:
        if current_offload_mode() is not None:
            raise RuntimeError(WRONG_ORDER)
        super().__enter__()
        return self

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if func not in HEAVY_OPS or func in _no_meta:
            return func(*args, **kwargs)
        if any(getattr(kind, "__torch_dispatch__", _DISABLED_DISPATCH) is not _DISABLED_DISPATCH
               for kind in types):
            return NotImplemented  # a subclass runs it; the plain ops it calls come back here
        if current_offload_mode() is not None:
            raise RuntimeError(WRONG_ORDER)
        leaves, _ = tree_flatten((args, kwargs))
        tensors = [t for t in leaves if isinstance(t, torch.Tensor)]
        if not tensors or any(t.device.type == "meta" for t in tensors):
            return func(*args, **kwargs)
        try:
            meta_args, meta_kwargs = tree_map(_on_meta, (args, kwargs))
            meta_out = func(*meta_args, **meta_kwargs)
        except Exception as exc:  # no meta kernel (or a real error, which the real run raises)
            _no_meta.add(func)
            log.warning("FastArithmetic: %s has no usable meta kernel here (%s: %s); it runs for real",
                        func, type(exc).__name__, exc)
            return func(*args, **kwargs)
        device = tensors[0].device
        self.skipped += 1
        self.skipped_by_op[str(func)] += 1
        return tree_map(lambda m: _zeros_like_meta(m, device), meta_out)


def _zeros_like_meta(m: Any, device: torch.device) -> Any:
    if not isinstance(m, torch.Tensor):
        return m
    return torch.empty_strided(m.shape, m.stride(), dtype=m.dtype, device=device).zero_()
