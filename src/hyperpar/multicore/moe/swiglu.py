"""SwiGLU on the ``[gate | up]`` rows of the up-projection, with its hand-written backward.

Backward recomputes the activation from the saved pre-activation instead of saving
both, which halves what the layer keeps for backward at the cost of one cheap pass.
The clamp masks follow ``torch.clamp``'s gradient convention (bounds included) so the
result matches autograd on the same formula.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

_BLOCK_ELEMENTS = 1 << 16  # of the pre-activation per row block: 128 rows at I = 256, 64 at I = 512


def _block_rows(pre: torch.Tensor) -> int:
    """Row blocks by size, not by count: 128-row blocks at I = 512 made the coarse bench step
    1-3 % slower than no blocks, 64-row ones were not (interleaved, moe_before_after)."""
    return max(1, _BLOCK_ELEMENTS // pre.shape[1])


def _limited(pre: torch.Tensor, limit: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    inter = pre.shape[1] // 2
    gate, up = pre[:, :inter], pre[:, inter:]
    if limit is not None:
        gate = gate.clamp(max=limit)
        up = up.clamp(-limit, limit)
    return gate, up


def swiglu(pre: torch.Tensor, limit: float | None) -> torch.Tensor:
    """``silu(g) * u`` for ``pre = [g | u]`` ([R, 2I] -> [R, I]); with ``limit``: g <= L, |u| <= L."""
    gate, up = _limited(pre, limit)
    return F.silu(gate).mul_(up)


def swiglu_as(pre: torch.Tensor, dtype: torch.dtype, limit: float | None,
              block_rows: int | None = None) -> torch.Tensor:
    """``swiglu`` computed in ``dtype`` for ``pre`` held in a narrower one (the ``gemm_dtype``
    opt-in), returned in ``pre``'s dtype: row blocks at a time, so the wide copy of ``pre`` and
    the wide activation are a block each (small, cache-resident, allocator-reused) instead of
    fresh [R, 2I] and [R, I] tensors; the values are those of casting ``pre`` up first and the
    result down (the formula is row by row)."""
    if pre.dtype == dtype:
        return swiglu(pre, limit)
    out = pre.new_empty(pre.shape[0], pre.shape[1] // 2)
    block_rows = block_rows or _block_rows(pre)
    for start in range(0, pre.shape[0], block_rows):
        rows = slice(start, start + block_rows)
        out[rows].copy_(swiglu(pre[rows].to(dtype), limit))
    return out


def swiglu_backward(pre: torch.Tensor, grad: torch.Tensor, limit: float | None,
                    scale: torch.Tensor | None = None, want_activation: bool = False,
                    want_scale_grad: bool = False,
                    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Gradient w.r.t. ``pre`` ([R, 2I]) given ``grad`` ([R, I]): the activation's gradient
    divided by the per-row ``scale`` ([R], None for 1; the route weight). Applying the route
    weight here rather than to the rows sent to the experts lets the same pass give its
    gradient ``<grad[r], act[r]>`` ([R], ``want_scale_grad``): that is ``<dy, y>`` for the route's
    output ``y = act @ down``, so the per-route outputs need not be saved for it. With
    ``want_activation`` also ``scale * act``, the down-projection weight gradient's left operand
    (computing it here shares one ``silu``). Two [R, I] temporaries at most beside the result;
    ``grad`` is only read."""
    inter = pre.shape[1] // 2
    gate, up = _limited(pre, limit)
    silu_gate = F.silu(gate)
    grad_up_term = grad * up  # silu_backward's input, and <grad, act> = <grad * up, silu(gate)>
    scale_grad = torch.linalg.vecdot(grad_up_term, silu_gate) if want_scale_grad else None
    if scale is not None:  # the route weight folded into the two factors that carry it
        column = scale.unsqueeze(1)
        grad_up_term.mul_(column)
        silu_gate.mul_(column)
    out = torch.empty_like(pre)
    grad_gate = out[:, :inter]
    grad_up = out[:, inter:]
    torch.ops.aten.silu_backward(grad_up_term, gate, grad_input=grad_gate)
    del grad_up_term
    torch.mul(grad, silu_gate, out=grad_up)
    if limit is not None:
        raw_gate, raw_up = pre[:, :inter], pre[:, inter:]
        grad_gate.masked_fill_(raw_gate > limit, 0)
        grad_up.masked_fill_((raw_up < -limit) | (raw_up > limit), 0)
    return out, (silu_gate.mul_(up) if want_activation else None), scale_grad


def swiglu_backward_as(pre: torch.Tensor, grad: torch.Tensor, dtype: torch.dtype, limit: float | None,
                       scale: torch.Tensor | None = None, want_activation: bool = False,
                       want_scale_grad: bool = False, block_rows: int = 128,
                       ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """``swiglu_backward`` computed in ``dtype`` for ``pre`` and ``grad`` held in a narrower one
    (the ``gemm_dtype`` opt-in): the pre-activation gradient and the scaled activation back in
    theirs, ``scale`` and its gradient in ``dtype``. Row blocks at a time, so the wide copies of
    ``pre``, ``grad`` and the intermediates are a block each, not [R, 2I] ones; the values are
    those of casting everything up first (the formula is row by row)."""
    if pre.dtype == dtype and grad.dtype == dtype:
        return swiglu_backward(pre, grad, limit, scale, want_activation, want_scale_grad)
    narrow = pre.dtype
    pre_grad = torch.empty_like(pre)
    act = pre.new_empty(pre.shape[0], pre.shape[1] // 2) if want_activation else None
    scale_grad = pre.new_empty(pre.shape[0], dtype=dtype) if want_scale_grad else None
    for start in range(0, pre.shape[0], block_rows):
        rows = slice(start, start + block_rows)
        part, part_act, part_scale_grad = swiglu_backward(
            pre[rows].to(dtype), grad[rows].to(dtype), limit,
            None if scale is None else scale[rows], want_activation, want_scale_grad)
        pre_grad[rows].copy_(part)
        if act is not None:
            assert part_act is not None
            act[rows].copy_(part_act.to(narrow))
        if scale_grad is not None:
            assert part_scale_grad is not None
            scale_grad[rows].copy_(part_scale_grad)
    return pre_grad, act, scale_grad
