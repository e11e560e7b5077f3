"""The package's GPT: config checks, causality, and that it trains."""

from __future__ import annotations

import re

import pytest
import torch

from hyperpar.models import GPT, GPTConfig, random_batch


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("n_layer", 0, "GPTConfig.n_layer must be a positive int, got 0"),
        ("d_model", True, "GPTConfig.d_model must be a positive int, got True"),
        ("vocab_size", 2.5, "GPTConfig.vocab_size must be a positive int, got 2.5"),
        ("dropout", 1.0, "GPTConfig.dropout must be in [0, 1), got 1.0"),
    ],
)
def test_config_errors_name_the_field(field: str, value: object, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        GPTConfig(**{field: value})


def test_d_model_must_split_into_heads() -> None:
    with pytest.raises(ValueError, match=r"d_model \(30\) must be divisible by n_head \(4\)"):
        GPTConfig(d_model=30, n_head=4)


def test_bad_inputs_are_named() -> None:
    model = GPT(GPTConfig.tiny())
    with pytest.raises(ValueError, match=r"idx must be \[batch, seq\]"):
        model(torch.zeros(16, dtype=torch.long))
    with pytest.raises(ValueError, match=r"exceeds GPTConfig\.seq_len=16"):
        model(torch.zeros(1, 17, dtype=torch.long))


def test_logits_at_a_position_ignore_later_tokens() -> None:
    torch.manual_seed(0)
    model = GPT(GPTConfig.tiny()).eval()
    idx, _ = random_batch(model.cfg, 2, torch.Generator().manual_seed(0))
    changed = idx.clone()
    changed[:, 10:] = (changed[:, 10:] + 1) % model.cfg.vocab_size
    a, b = model(idx), model(changed)
    assert torch.equal(a[:, :10], b[:, :10])
    assert not torch.equal(a[:, 10:], b[:, 10:])


def test_loss_goes_down_with_sgd() -> None:
    torch.manual_seed(0)
    model = GPT(GPTConfig.tiny())
    idx, targets = random_batch(model.cfg, 4, torch.Generator().manual_seed(1))
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for _ in range(10):
        loss = model.loss(idx, targets)
        losses.append(loss.item())
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert losses[-1] < losses[0] - 0.5, losses


def test_ffn_factory_replaces_every_feed_forward() -> None:
    cfg = GPTConfig.tiny()
    model = GPT(cfg, ffn_factory=lambda c, i: torch.nn.Identity())
    assert all(isinstance(b.ffn, torch.nn.Identity) for b in model.blocks)
