"""Swap the routed experts of a Hugging Face sparse-MoE block (Mixtral, Qwen2-MoE) for MoeExperts.

transformers 5.x keeps a block's experts in one module with 3-D weights
``gate_up_proj [E, 2I, H]`` (gate rows first) and ``down_proj [E, H, I]`` whose
``forward(hidden, top_k_index, top_k_weights)`` is ours, so the swap is a module
replacement with transposed weight slices for this rank's experts. transformers 4.x
kept a ``ModuleList`` of per-expert MLPs and looped inside the block; that layout is
rejected with a clear error.
"""

from __future__ import annotations

from typing import Any

import torch

from .module import MoeExperts


def _experts_of(block: torch.nn.Module) -> torch.nn.Module:
    experts = getattr(block, "experts", None)
    if experts is None:
        raise TypeError(f"{type(block).__name__} has no .experts: not a Hugging Face sparse-MoE block")
    if isinstance(experts, torch.nn.ModuleList):
        raise TypeError(
            f"{type(block).__name__}.experts is a ModuleList (transformers 4.x layout); "
            "MoeExperts replaces the 3-D expert layout of transformers >= 5")
    if not hasattr(experts, "gate_up_proj") or not hasattr(experts, "down_proj"):
        raise TypeError(f"{type(experts).__name__} lacks gate_up_proj/down_proj")
    return experts


def moe_experts_from_hf(block: torch.nn.Module, *, local_num_tokens: int, top_k: int | None = None,
                        ep_size: int = 1, ep_group: Any = None, **kwargs: Any) -> MoeExperts:
    """A MoeExperts holding this rank's slice of ``block.experts``'s weights (same dtype/device)."""
    experts = _experts_of(block)
    gate_up = experts.gate_up_proj.detach()  # [E, 2I, H]
    down = experts.down_proj.detach()  # [E, H, I]
    num_experts, two_inter, hidden = gate_up.shape
    if top_k is None:
        top_k = int(getattr(block, "top_k", getattr(getattr(block, "gate", None), "top_k", 0)))
    act = getattr(experts, "act_fn", None)
    act_name = type(act).__name__.lower()
    if act is not None and "silu" not in act_name and "swish" not in act_name:
        raise TypeError(f"{type(experts).__name__} uses {type(act).__name__}; "
                        "MoeExperts computes SwiGLU (SiLU)")
    module = MoeExperts(local_num_tokens=local_num_tokens, hidden_size=hidden,
                        intermediate_size=two_inter // 2, num_experts=num_experts, top_k=top_k,
                        ep_size=ep_size, ep_group=ep_group, **kwargs)
    ids = module.local_expert_ids
    with torch.no_grad():
        module.to(device=gate_up.device, dtype=gate_up.dtype)
        module.gate_up_weight.copy_(gate_up[ids.start:ids.stop].transpose(1, 2))
        module.down_weight.copy_(down[ids.start:ids.stop].transpose(1, 2))
    return module


def replace_hf_moe_experts(block: torch.nn.Module, **kwargs: Any) -> MoeExperts:
    """Replace ``block.experts`` in place by a MoeExperts (see ``moe_experts_from_hf``) and return it."""
    module = moe_experts_from_hf(block, **kwargs)
    block.experts = module
    return module
