"""MoeFeedForward on one rank: router top-k + MoeExperts equals the dense reference, grads flow."""

from __future__ import annotations

import pytest
import torch

from hyperpar.models import GPT, GPTConfig, MoeFeedForward, moe_ffn_factory, random_batch
from hyperpar.multicore.moe import dense_moe_reference


def test_matches_dense_reference_and_trains_the_router() -> None:
    torch.manual_seed(0)
    cfg = GPTConfig.tiny()
    ffn = MoeFeedForward(cfg, num_experts=4, top_k=2, max_tokens=64)
    x = torch.randn(2, 16, cfg.d_model, requires_grad=True)
    try:
        y = ffn(x)
        flat = x.detach().reshape(-1, cfg.d_model)
        weights, ids = torch.softmax(ffn.router(flat), dim=-1).topk(2, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        want = dense_moe_reference(flat, ids, weights, ffn.experts.gate_up_weight, ffn.experts.down_weight)
        assert y.shape == x.shape
        torch.testing.assert_close(y.reshape(-1, cfg.d_model), want, rtol=1e-5, atol=1e-6)
        y.square().sum().backward()
        assert ffn.router.weight.grad is not None and ffn.router.weight.grad.abs().sum() > 0
        assert ffn.experts.gate_up_weight.grad is not None
    finally:
        ffn.experts.close()


def test_gpt_with_moe_blocks_runs_a_step() -> None:
    torch.manual_seed(0)
    cfg = GPTConfig.tiny()
    model = GPT(cfg, ffn_factory=moe_ffn_factory(num_experts=2, top_k=1, max_tokens=2 * cfg.seq_len))
    try:
        assert all(isinstance(b.ffn, MoeFeedForward) for b in model.blocks)
        loss = model.loss(*random_batch(cfg, 2))
        loss.backward()
        assert torch.isfinite(loss)
    finally:
        for block in model.blocks:
            block.ffn.experts.close()


def test_bad_top_k_is_named() -> None:
    with pytest.raises(ValueError, match="top_k must be an int in \\[1, num_experts=2\\], got 3"):
        MoeFeedForward(GPTConfig.tiny(), num_experts=2, top_k=3, max_tokens=8)
