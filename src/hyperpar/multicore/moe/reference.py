"""The routed-experts math written per token with plain autograd ops: the yardstick for tests.

It holds all experts' weights on one rank and gathers each token's expert matrices,
so it is only for small checks, never for training.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def dense_moe_reference(hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                        gate_up: torch.Tensor, down: torch.Tensor,
                        swiglu_limit: float | None = None) -> torch.Tensor:
    """``y[t] = sum_k w[t,k] * (silu(g) * u) @ down[e]`` with ``[g | u] = x[t] @ gate_up[e]``.

    ``gate_up`` [E, H, 2I] and ``down`` [E, I, H] hold every expert; hidden is [T, H].
    """
    inter = down.shape[1]
    pre = torch.einsum("th,tkhj->tkj", hidden, gate_up[topk_ids])
    gate, up = pre[..., :inter], pre[..., inter:]
    if swiglu_limit is not None:
        gate = torch.clamp(gate, max=swiglu_limit)
        up = torch.clamp(up, -swiglu_limit, swiglu_limit)
    per_route = torch.einsum("tki,tkih->tkh", F.silu(gate) * up, down[topk_ids])
    return torch.einsum("tk,tkh->th", topk_weights.to(per_route.dtype), per_route)
