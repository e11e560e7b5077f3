"""Llama-style decoder: shapes, causality, GQA against an explicit reference, training, config errors."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from hyperpar.models import Llama, LlamaConfig, random_batch
from hyperpar.models.llama import apply_rotary


def _model(cfg: LlamaConfig, seed: int = 0) -> Llama:
    torch.manual_seed(seed)
    return Llama(cfg)


def test_logits_shape_and_parameter_count() -> None:
    cfg = LlamaConfig.tiny()
    model = _model(cfg)
    idx, _ = random_batch(cfg, 3, torch.Generator().manual_seed(1))
    logits = model(idx)
    assert logits.shape == (3, cfg.seq_len, cfg.vocab_size)
    assert logits.dtype == torch.float32
    assert cfg.num_parameters() == sum(p.numel() for p in model.parameters())
    short = model(idx[:, :5])
    assert short.shape == (3, 5, cfg.vocab_size)


def test_future_tokens_do_not_change_past_logits() -> None:
    cfg = LlamaConfig.tiny()
    model = _model(cfg)
    idx, _ = random_batch(cfg, 2, torch.Generator().manual_seed(2))
    changed = idx.clone()
    cut = 7
    changed[:, cut + 1:] = (changed[:, cut + 1:] + 1) % cfg.vocab_size
    with torch.no_grad():
        a, b = model(idx), model(changed)
    torch.testing.assert_close(a[:, : cut + 1], b[:, : cut + 1], rtol=0, atol=1e-6)
    assert not torch.allclose(a[:, cut + 1:], b[:, cut + 1:])


def test_grouped_query_attention_matches_repeated_heads() -> None:
    cfg = LlamaConfig.tiny()
    model = _model(cfg)
    attn = model.blocks[0].attn
    x = torch.randn(2, cfg.seq_len, cfg.d_model, generator=torch.Generator().manual_seed(3))
    cos, sin = model.rope_cos, model.rope_sin
    b, t, _ = x.shape
    rep = cfg.n_head // cfg.n_kv_head
    q = apply_rotary(attn.q(x).view(b, t, cfg.n_head, cfg.head_dim).transpose(1, 2), cos, sin)
    k = apply_rotary(attn.k(x).view(b, t, cfg.n_kv_head, cfg.head_dim).transpose(1, 2), cos, sin)
    v = attn.v(x).view(b, t, cfg.n_kv_head, cfg.head_dim).transpose(1, 2)
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scores = (q @ k.transpose(-1, -2)) / cfg.head_dim**0.5
    scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    expected = attn.o((scores.softmax(-1) @ v).transpose(1, 2).reshape(b, t, cfg.d_model))
    with torch.no_grad():
        torch.testing.assert_close(attn(x, cos, sin), expected, rtol=1e-5, atol=1e-5)


def test_rotary_preserves_norm_and_rotates() -> None:
    cfg = LlamaConfig.tiny()
    model = _model(cfg)
    x = torch.randn(1, 1, cfg.seq_len, cfg.head_dim, generator=torch.Generator().manual_seed(4))
    y = apply_rotary(x, model.rope_cos, model.rope_sin)
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1))
    assert torch.equal(y[..., 0, :], x[..., 0, :])  # position 0: angle 0
    assert not torch.allclose(y[..., 1:, :], x[..., 1:, :])


def test_loss_decreases_over_a_few_sgd_steps() -> None:
    cfg = LlamaConfig.tiny()
    model = _model(cfg)
    idx, targets = random_batch(cfg, 4, torch.Generator().manual_seed(5))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for _ in range(6):
        loss = model.loss(idx, targets)
        losses.append(loss.item())
        loss.backward()
        opt.step()
        opt.zero_grad()
    assert losses[-1] < losses[0] - 0.05, losses
    uniform = F.cross_entropy(torch.zeros(1, cfg.vocab_size), torch.zeros(1).long()).item()
    assert abs(losses[0] - uniform) < 1.0  # a fresh model starts near the uniform guess


def test_bfloat16_forward_and_backward() -> None:
    cfg = LlamaConfig.tiny()
    model = _model(cfg).to(torch.bfloat16)
    idx, targets = random_batch(cfg, 2, torch.Generator().manual_seed(6))
    loss = model.loss(idx, targets)
    loss.backward()
    assert torch.isfinite(loss)
    assert model.blocks[0].mlp.gate.weight.grad is not None
    assert model.blocks[0].mlp.gate.weight.grad.dtype == torch.bfloat16


def test_too_long_sequence_names_the_limit() -> None:
    cfg = LlamaConfig.tiny()
    model = _model(cfg)
    with pytest.raises(ValueError, match="seq_len=16"):
        model(torch.zeros(1, cfg.seq_len + 1, dtype=torch.long))
    with pytest.raises(ValueError, match=r"\[batch, seq\]"):
        model(torch.zeros(cfg.seq_len, dtype=torch.long))


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"vocab_size": 0}, "vocab_size"),
        ({"n_layer": -1}, "n_layer"),
        ({"n_head": True}, "n_head"),
        ({"ffn_hidden": 2.5}, "ffn_hidden"),
        ({"d_model": 30}, "d_model"),
        ({"n_kv_head": 3}, "n_head"),
        ({"d_model": 36, "n_head": 4}, "head_dim"),
        ({"rope_theta": float("nan")}, "rope_theta"),
        ({"norm_eps": 0.0}, "norm_eps"),
        ({"norm_eps": "1e-5"}, "norm_eps"),
    ],
)
def test_config_validation_names_the_field(change: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        dataclasses.replace(LlamaConfig.tiny(), **change)


def test_presets_are_valid_and_ordered() -> None:
    sizes = [c.num_parameters() for c in (LlamaConfig.tiny(), LlamaConfig.small(), LlamaConfig.medium())]
    assert sizes == sorted(sizes)
    big = LlamaConfig.llama3_8b_shape()
    assert 7.0e9 < big.num_parameters() < 8.1e9
