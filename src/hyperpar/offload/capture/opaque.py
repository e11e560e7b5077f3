"""skip_offload regions: one opaque op in forward and one in backward.

The region runs under an autograd.Function that keeps the region's own graph and runs
it reentrantly in backward, so the backward of the region is also contiguous and can be
recorded as a single op. Inside, ops are not traced (but evicted inputs are still paged
in), so data-dependent control flow inside the region replays fine.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from hyperpar.offload.capture.executor_base import ExecutorBase

Tensor = torch.Tensor
# Makes the region's output require grad when only parameters inside it do (never gets a grad).
_GRAD_ANCHOR = torch.empty(0, requires_grad=True)


class _Raised:
    """Raise one of the executor's depth counters for a block: ``passthrough`` (ops run
    untouched while the executor does its own bookkeeping) or ``opaque_depth`` (ops run
    untraced inside the region)."""

    def __init__(self, ex: ExecutorBase, counter: str) -> None:
        self.ex, self.counter = ex, counter

    def __enter__(self) -> None:
        setattr(self.ex, self.counter, getattr(self.ex, self.counter) + 1)

    def __exit__(self, *exc: object) -> None:
        setattr(self.ex, self.counter, getattr(self.ex, self.counter) - 1)


def _internal(ex: ExecutorBase) -> _Raised:
    return _Raised(ex, "passthrough")


def _untraced(ex: ExecutorBase) -> _Raised:
    return _Raised(ex, "opaque_depth")


def _storage_refs(ex: ExecutorBase, tensors: list[Tensor]) -> list[weakref.ref]:
    return [weakref.ref(st) for st in ex.device_storages(tensors)]


class _OpaqueRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, ex: ExecutorBase, name: str, fn: Any, flat: list[Any], spec: Any,
                positions: list[int], box: dict[str, Any], _anchor: Tensor, *tensors: Tensor) -> Any:
        with _internal(ex):
            token = ex.begin_opaque(name, ex.device_storages(list(tensors)))
        with _untraced(ex), torch.enable_grad():
            detached = []
            for t in tensors:
                d = t.detach()
                if t.requires_grad:
                    d.requires_grad_(True)
                detached.append(d)
            values = list(flat)
            for pos, d in zip(positions, detached, strict=True):
                values[pos] = d
            args, kwargs = tree_unflatten(values, spec)
            out = fn(*args, **kwargs)
            out_flat, out_spec = tree_flatten(out)
            out_pos = [i for i, o in enumerate(out_flat) if isinstance(o, Tensor)]
            inner = [out_flat[i] for i in out_pos]
            results = tuple(o.detach() for o in inner)
        with _internal(ex):
            ex.end_opaque(token, list(inner))
        box.update(flat=out_flat, spec=out_spec, positions=out_pos)
        ctx.ex, ctx.name = ex, name
        ctx.inner = inner
        ctx.leaves = [d if d.requires_grad else None for d in detached]
        # Backward reads the region's inputs and outputs (its inner graph saved them).
        ctx.reads = _storage_refs(ex, list(tensors) + inner)
        ctx.mark_non_differentiable(*(r for r, o in zip(results, inner, strict=True) if not o.requires_grad))
        return results

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> Any:
        ex: ExecutorBase = ctx.ex
        live = ex.opaque_depth == 0 and not ex.closed
        token = None
        if live:
            reads = [st for st in (r() for r in ctx.reads) if st is not None]
            with _internal(ex):
                token = ex.begin_opaque(ctx.name + ".backward",
                                        reads + ex.device_storages([g for g in grads if g is not None]))
        with _untraced(ex), torch.enable_grad():
            pairs = [(o, g) for o, g in zip(ctx.inner, grads, strict=True)
                     if o.requires_grad and g is not None]
            if pairs:
                torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
            input_grads = [None if d is None else d.grad for d in ctx.leaves]
        if live:
            with _internal(ex):
                ex.end_opaque(token, [g for g in input_grads if g is not None])
        ctx.inner = ctx.leaves = ctx.reads = None
        return (None,) * 8 + tuple(input_grads)


def run_opaque(ex: ExecutorBase, name: str, fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Run ``fn`` as one op of ``ex`` (forward and, when grad is enabled, backward)."""
    flat, spec = tree_flatten((args, kwargs))
    positions = [i for i, a in enumerate(flat) if isinstance(a, Tensor)]
    tensors = [flat[i] for i in positions]
    if not torch.is_grad_enabled():
        with _internal(ex):
            token = ex.begin_opaque(name, ex.device_storages(tensors))
        with _untraced(ex):
            out = fn(*args, **kwargs)
        with _internal(ex):
            ex.end_opaque(token, [o for o in tree_flatten(out)[0] if isinstance(o, Tensor)])
        return out
    box: dict[str, Any] = {}
    results = _OpaqueRegion.apply(ex, name, fn, flat, spec, positions, box, _GRAD_ANCHOR, *tensors)
    values = list(box["flat"])
    for pos, r in zip(box["positions"], results, strict=True):
        values[pos] = r
    return tree_unflatten(values, box["spec"])

