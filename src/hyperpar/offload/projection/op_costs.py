"""FLOPs and bytes of each op in a trace, from the op's name and the shapes the trace recorded.

A trace keeps, per op, the shapes of its outputs (``OpGuide.output_meta``), which of its
inputs are activations (``OpGuide.input_sids``) and every activation storage's size; it does
not keep the shapes of parameters or of inputs from outside the step. So a matmul's inner
dimension comes from whichever operand is an activation (its storage size over the output's
rows or columns), and the parameter operand's bytes follow from it. Every other op moves the
bytes of the storages it reads and writes; an op that writes no storage (a view, ``t``,
``detach``) launches no kernel. A trace without guides (a synthetic one) has no shapes: every
op's cost is its storages' bytes and its FLOPs are unknown (0), which ``TraceCosts`` says.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch

from hyperpar.offload.ir import ActivationTrace
from hyperpar.offload.ir.guide import OpGuide
from hyperpar.offload.ir.trace import AccessKind, TraceOp

log = logging.getLogger(__name__)

MATMULS = frozenset({"mm", "addmm", "bmm", "baddbmm", "linear", "matmul"})
# FLOPs of an attention backward over its forward: two matmuls forward, five backward.
SDPA_BACKWARD_FACTOR = 2.5


@dataclass(frozen=True, slots=True)
class OpCost:
    """``kernel``: the op writes a storage, so it runs on the device; ``flops_known``: FLOPs
    came from shapes (False for a matmul whose operands are all from outside the step)."""

    flops: float
    bytes: float
    kernel: bool
    flops_known: bool = True


@dataclass(frozen=True)
class TraceCosts:
    ops: list[OpCost]
    has_shapes: bool  # the trace had guides: matmul and attention FLOPs were derived

    @property
    def flops_unknown(self) -> int:
        """Ops whose FLOPs could not be derived (counted at their bytes alone)."""
        return sum(1 for c in self.ops if not c.flops_known)

    @property
    def total_flops(self) -> float:
        return sum(c.flops for c in self.ops)

    @property
    def total_bytes(self) -> float:
        return sum(c.bytes for c in self.ops)


def base_name(name: str) -> str:
    """``aten.mm.default`` -> ``mm``; a name without a namespace is kept whole."""
    parts = name.split(".")
    return parts[1] if len(parts) >= 2 and parts[0] in ("aten", "prims") else parts[0]


def _itemsize(dtype_name: str) -> int:
    dtype = getattr(torch, dtype_name.removeprefix("torch."), None)
    return dtype.itemsize if isinstance(dtype, torch.dtype) else 4


def op_costs(trace: ActivationTrace) -> TraceCosts:
    """One ``OpCost`` per op of ``trace``."""
    has_shapes = len(trace.guides) == trace.num_ops and trace.num_ops > 0
    if not has_shapes and trace.num_ops:
        log.warning("the trace records no shapes (no guides): FLOPs are unknown, every op is "
                    "costed by the bytes of the storages it accesses")
    costs = [_cost(op, trace.guides[i] if has_shapes else None, trace.storage_sizes)
             for i, op in enumerate(trace.ops)]
    return TraceCosts(costs, has_shapes)


def _cost(op: TraceOp, guide: OpGuide | None, sizes: dict[int, int]) -> OpCost:
    kernel = any(a.kind is AccessKind.WRITE for a in op.accesses)
    moved = float(sum(sizes.get(a.storage_id, 0) for a in op.accesses))
    if not kernel:
        return OpCost(0.0, 0.0, False)
    if guide is None:
        return OpCost(0.0, moved, True, flops_known=False)
    name = base_name(op.name)
    if name in MATMULS:
        return _matmul(name, guide, sizes, moved)
    if "scaled_dot_product" in name:
        return _attention(name, guide, sizes, moved)
    return OpCost(0.0, moved, True)


def _first_out(guide: OpGuide) -> tuple[tuple[int, ...], int] | None:
    for meta in guide.output_meta:
        if meta is not None:
            return meta[0], _itemsize(meta[1])
    return None


def _numel(sid: int, sizes: dict[int, int], itemsize: int) -> int | None:
    return sizes[sid] // itemsize if sid >= 0 and sid in sizes else None


def _matmul(name: str, guide: OpGuide, sizes: dict[int, int], moved: float) -> OpCost:
    out = _first_out(guide)
    ins = guide.input_sids[1:] if name in ("addmm", "baddbmm") else guide.input_sids
    if out is None or len(ins) < 2 or not out[0]:
        return OpCost(0.0, moved, True, flops_known=False)
    shape, itemsize = out
    cols = shape[-1]
    rows = math.prod(shape[:-1])  # batch x M (bmm) or every leading dim (linear)
    batch = shape[0] if name in ("bmm", "baddbmm") and len(shape) == 3 else 1
    a, b = _numel(ins[0], sizes, itemsize), _numel(ins[1], sizes, itemsize)
    if a is not None and rows:
        inner = a // rows
    elif b is not None and cols:
        inner = b // (batch * cols)
    else:
        return OpCost(0.0, moved, True, flops_known=False)
    flops = 2.0 * rows * cols * inner
    # the operand that is a parameter (or from outside the step) is not in ``moved``
    missing = (0 if a is not None else rows * inner) + (0 if b is not None else batch * inner * cols)
    return OpCost(flops, moved + missing * itemsize, True)


def _attention(name: str, guide: OpGuide, sizes: dict[int, int], moved: float) -> OpCost:
    out = _first_out(guide)
    if out is None or len(out[0]) != 4:
        return OpCost(0.0, moved, True, flops_known=False)
    (b, h, q_len, e), itemsize = out  # the output (forward) or the query's gradient (backward)
    key_sid = guide.input_sids[2 if "backward" in name else 1] if len(guide.input_sids) > 2 else -1
    keys = _numel(key_sid, sizes, itemsize)
    kv_len = q_len  # self-attention; keys with fewer (grouped) heads still span q_len
    if keys and b * q_len * e and not (keys % (b * q_len * e) == 0 and h % (keys // (b * q_len * e)) == 0):
        kv_len = keys // (b * h * e)
    flops = 4.0 * b * h * q_len * kv_len * e
    if "backward" in name:
        flops *= SDPA_BACKWARD_FACTOR
    return OpCost(flops, moved, True)
