"""A mixture-of-experts feed-forward for :class:`~hyperpar.models.GPT`: router + ``MoeExperts``.

The router is a plain linear layer with a softmax over experts; each token goes to its
``top_k`` best experts with the chosen probabilities renormalised to sum to one (so the
layer's output scale does not depend on ``top_k``). The experts themselves are a
:class:`~hyperpar.multicore.moe.MoeExperts`, expert-parallel over ``ep_group`` when
``ep_size > 1``. Plug it into a GPT with :func:`moe_ffn_factory`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from hyperpar.models.gpt import GPTConfig
from hyperpar.multicore.moe import MoeExperts


class MoeFeedForward(nn.Module):
    """``forward(x [..., d_model]) -> [..., d_model]``; at most ``max_tokens`` tokens per call."""

    def __init__(
        self, cfg: GPTConfig, *, num_experts: int, top_k: int, max_tokens: int,
        intermediate_size: int | None = None, ep_size: int = 1, ep_group: Any = None,
    ) -> None:
        super().__init__()
        if isinstance(top_k, bool) or not isinstance(top_k, int) or not 0 < top_k <= num_experts:
            raise ValueError(f"top_k must be an int in [1, num_experts={num_experts}], got {top_k!r}")
        if intermediate_size is None:
            # same parameter count per token as the dense MLP: top_k experts of SwiGLU width
            intermediate_size = max(1, cfg.mlp_ratio * cfg.d_model // (2 * top_k))
        self.top_k = top_k
        self.router = nn.Linear(cfg.d_model, num_experts, bias=False)
        self.experts = MoeExperts(
            local_num_tokens=max_tokens, hidden_size=cfg.d_model, intermediate_size=intermediate_size,
            num_experts=num_experts, top_k=top_k, ep_size=ep_size, ep_group=ep_group,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        probs = torch.softmax(self.router(flat), dim=-1)
        weights, ids = probs.topk(self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return self.experts(flat, ids, weights).view(x.shape)


def moe_ffn_factory(
    *, num_experts: int, top_k: int, max_tokens: int, intermediate_size: int | None = None,
    ep_size: int = 1, ep_group: Any = None,
) -> Callable[[GPTConfig, int], MoeFeedForward]:
    """``GPT(cfg, ffn_factory=moe_ffn_factory(...))``: every block gets an MoE feed-forward."""

    def make(cfg: GPTConfig, layer_index: int) -> MoeFeedForward:
        return MoeFeedForward(cfg, num_experts=num_experts, top_k=top_k, max_tokens=max_tokens,
                              intermediate_size=intermediate_size, ep_size=ep_size, ep_group=ep_group)

    return make
