"""Issue 12: a HF Llama trained with a random sequence length every step replays one plan
per size class (no warmup per length), bitwise equal to plain PyTorch, every step within its
budget, and host memory stops growing once the lengths seen repeat."""

from __future__ import annotations

import random

import pytest
import torch

from hyperpar.offload import OffloadConfig, OffloadSession
from tests.step_context import step_context

transformers = pytest.importorskip("transformers")

STEPS = 44
MIB = 1 << 20


def _llama() -> torch.nn.Module:
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg)


def _ids(length: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (2, length), generator=torch.Generator().manual_seed(seed))


def _step(model: torch.nn.Module, ids: torch.Tensor, session: OffloadSession | None) -> torch.Tensor:
    with step_context(session):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
    return loss.detach()


def assert_same_step(expected: torch.Tensor, got: torch.Tensor, plain: torch.nn.Module,
                     off: torch.nn.Module, where: str) -> None:
    """The loss and every parameter's gradient bitwise equal."""
    assert torch.equal(expected, got), where
    for (name, a), b in zip(plain.named_parameters(), off.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad), f"{where}: grad of {name}"


def test_random_lengths_replay_within_budget_and_bitwise() -> None:
    torch.set_num_threads(1)
    plain, off = _llama(), _llama()
    off.load_state_dict(plain.state_dict())
    probe = OffloadSession(OffloadConfig(max_resident_activation_mb=float(1 << 20)))
    _step(off, _ids(256, 0), probe)
    off.zero_grad(set_to_none=True)
    assert probe.last_report is not None
    budget = int(probe.last_report.peak_resident_bytes * 0.4)
    session = OffloadSession(OffloadConfig(max_resident_activation_mb=budget / MIB))
    rng = random.Random(0)
    lengths = [rng.randint(32, 256) for _ in range(STEPS)]
    warmups, held, allocations = 0, [], []
    for step, length in enumerate(lengths):
        ids = _ids(length, step)
        loss_plain, loss_off = _step(plain, ids, None), _step(off, ids, session)
        report = session.last_report
        assert report is not None
        where = f"step {step}, length {length}: {report}"
        assert_same_step(loss_plain, loss_off, plain, off, where)
        warmups += report.phase == "warmup"
        assert report.diverged_at is None, where
        if report.min_feasible_budget_bytes is None or report.min_feasible_budget_bytes <= budget:
            assert report.peak_resident_bytes <= budget * 1.05, where
        held.append(session.held_bytes())
        allocations.append(session.host_allocations())
        plain.zero_grad(set_to_none=True)
        off.zero_grad(set_to_none=True)
    assert warmups <= 2, f"{warmups} warmups over {STEPS} steps"
    half = STEPS // 2
    assert max(held[half:]) <= 2 * max(held[:half]), f"host bytes grew: {held}"
    assert allocations[-1] - allocations[half] <= allocations[half] // 4, f"allocations grew: {allocations}"
