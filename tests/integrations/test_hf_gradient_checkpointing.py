"""HF activation checkpointing (``activation_checkpointing_enable``, reentrant and not) inside an
OffloadSession, with dropout and another batch and length every step: the recomputed forward
runs inside backward, under the same session, and must replay its dropout masks (the session
draws no random numbers). Bitwise equal to plain every step, one warmup, budgets kept.
Coverage of a common fine-tuning set-up (it passed when added)."""

from __future__ import annotations

import random

import pytest
import torch

from hyperpar.offload import OffloadConfig, OffloadSession
from tests.offload.test_variable_lengths import _step as lm_step
from tests.offload.test_variable_lengths import assert_same_step

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.hf
MIB = 1 << 20


def _gpt2(reentrant: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=256, n_embd=64, n_layer=2, n_head=4, n_positions=256, bos_token_id=0, eos_token_id=0))
    kwargs = {"use_reentrant": reentrant}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x's name
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    return model.train()  # dropout on


def _step(model: torch.nn.Module, ids: torch.Tensor, session: OffloadSession | None,
          seed: int) -> torch.Tensor:
    torch.manual_seed(seed)  # the same dropout masks on both sides
    return lm_step(model, ids, session)


@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpointed_gpt2_with_dropout_and_variable_shapes(reentrant: bool) -> None:
    torch.set_num_threads(1)
    plain, off = _gpt2(reentrant), _gpt2(reentrant)
    probe = OffloadSession(OffloadConfig(max_resident_activation_mb=float(1 << 20)))
    largest = torch.randint(0, 256, (4, 200), generator=torch.Generator().manual_seed(0))
    _step(_gpt2(reentrant), largest, probe, 0)
    assert probe.last_report is not None
    budget = int(probe.last_report.peak_resident_bytes * 0.4)
    session = OffloadSession(OffloadConfig(max_resident_activation_mb=budget / MIB))
    rng = random.Random(0)
    warmups = moved = 0
    for step in range(6):
        shape = (rng.randint(2, 4), rng.randint(32, 200))
        ids = torch.randint(0, 256, shape, generator=torch.Generator().manual_seed(step))
        expected, got = _step(plain, ids, None, 100 + step), _step(off, ids, session, 100 + step)
        report = session.last_report
        assert report is not None
        assert_same_step(expected, got, plain, off, f"step {step}, shape {shape}: {report}")
        moved += report.bytes_d2h
        warmups += report.phase == "warmup"
        floor = report.min_feasible_budget_bytes or 0
        if floor <= budget:
            assert report.peak_resident_bytes <= max(1.05 * budget, budget + (64 << 10)), report
        plain.zero_grad(set_to_none=True)
        off.zero_grad(set_to_none=True)
    assert warmups == 1
    assert moved > 0
