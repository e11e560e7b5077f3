"""SwiGLU on the ``[gate | up]`` rows of the up-projection, with its hand-written backward.

Backward recomputes the activation from the saved pre-activation instead of saving
both, which halves what the layer keeps for backward at the cost of one cheap pass.
The clamp masks follow ``torch.clamp``'s gradient convention (bounds included) so the
result matches autograd on the same formula.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


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


def swiglu_backward(pre: torch.Tensor, grad: torch.Tensor, limit: float | None,
                    want_activation: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gradient w.r.t. ``pre`` ([R, 2I]) given the activation's gradient ([R, I]), and the
    recomputed activation when ``want_activation`` (the down-projection's weight gradient
    needs it; computing both shares one ``silu``)."""
    inter = pre.shape[1] // 2
    gate, up = _limited(pre, limit)
    silu_gate = F.silu(gate)
    out = torch.empty_like(pre)
    grad_gate = out[:, :inter]
    grad_up = out[:, inter:]
    torch.ops.aten.silu_backward(grad * up, gate, grad_input=grad_gate)
    torch.mul(grad, silu_gate, out=grad_up)
    if limit is not None:
        raw_gate, raw_up = pre[:, :inter], pre[:, inter:]
        grad_gate.masked_fill_(raw_gate > limit, 0)
        grad_up.masked_fill_((raw_up < -limit) | (raw_up > limit), 0)
    return out, (silu_gate.mul_(up) if want_activation else None)


def swiglu_backward_as(pre: torch.Tensor, grad: torch.Tensor, dtype: torch.dtype, limit: float | None,
                       want_activation: bool = False, block_rows: int = 128,
                       ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``swiglu_backward`` computed in ``dtype`` for ``pre`` and ``grad`` held in a narrower one
    (the ``gemm_dtype`` opt-in), results back in theirs. Row blocks at a time, so the wide
    copies of ``pre``, ``grad`` and the intermediates are a block each, not [R, 2I] ones; the
    values are those of casting everything up first (the formula is row by row)."""
    if pre.dtype == dtype and grad.dtype == dtype:
        return swiglu_backward(pre, grad, limit, want_activation)
    narrow = pre.dtype
    pre_grad = torch.empty_like(pre)
    act = pre.new_empty(pre.shape[0], pre.shape[1] // 2) if want_activation else None
    for start in range(0, pre.shape[0], block_rows):
        rows = slice(start, start + block_rows)
        part, part_act = swiglu_backward(pre[rows].to(dtype), grad[rows].to(dtype), limit, want_activation)
        pre_grad[rows].copy_(part)
        if act is not None:
            assert part_act is not None
            act[rows].copy_(part_act.to(narrow))
    return pre_grad, act
