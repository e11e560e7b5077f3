"""Bitwise equality with and without offload on whole models: the package GPT and three
Hugging Face transformers built from tiny configs with random weights (nothing downloaded)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hyperpar.models.gpt import GPT, GPTConfig, random_batch
from hyperpar.offload import OffloadConfig, OffloadSession
from tests.offload.equality_harness import MIB, Case, measure_peak, run_equality

GPT_CFG = GPTConfig(vocab_size=64, seq_len=32, n_layer=2, n_head=2, d_model=32, dropout=0.1)


def _gpt_case(batch: int = 4) -> Case:
    def inputs(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        return random_batch(GPT_CFG, batch, torch.Generator().manual_seed(step))

    return Case("gpt", lambda: GPT(GPT_CFG), inputs, loss=lambda m, a: m.loss(*a))


class _HFCausalLM(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=ids, labels=ids).loss


def _hf(kind: str) -> nn.Module:
    transformers = pytest.importorskip("transformers")
    common = dict(vocab_size=128, num_hidden_layers=2, num_attention_heads=4)
    if kind == "llama":
        cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_key_value_heads=2,
                                       max_position_embeddings=64, **common)
        model = transformers.LlamaForCausalLM(cfg)
    elif kind == "gpt2":
        cfg = transformers.GPT2Config(vocab_size=128, n_positions=64, n_embd=32, n_layer=2, n_head=4,
                                      bos_token_id=0, eos_token_id=0)
        model = transformers.GPT2LMHeadModel(cfg)
    else:
        cfg = transformers.MixtralConfig(hidden_size=32, intermediate_size=64, num_key_value_heads=2,
                                         num_local_experts=4, num_experts_per_tok=2,
                                         max_position_embeddings=64, **common)
        model = transformers.MixtralForCausalLM(cfg)
    return _HFCausalLM(model.train())


def _ids(step: int) -> tuple[torch.Tensor]:
    return (torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(step)),)


MODEL_CASES = [
    _gpt_case(),
    Case("hf_llama", lambda: _hf("llama"), _ids),
    Case("hf_gpt2", lambda: _hf("gpt2"), _ids),
    Case("hf_mixtral", lambda: _hf("mixtral"), _ids),
]


@pytest.mark.parametrize("case", MODEL_CASES, ids=[c.name for c in MODEL_CASES])
def test_models_bitwise_equal_at_every_budget(case: Case) -> None:
    torch.set_num_threads(1)
    run_equality(case)


def test_gpt_bitwise_equal_with_the_timed_planner() -> None:
    torch.set_num_threads(1)
    reports = run_equality(_gpt_case(), fractions=(0.5, 0.0), planner="timed")
    assert all(r.predicted_step_ms is not None for r in reports[0.5][1:])


def test_gpt_peak_within_budget_at_half_of_peak() -> None:
    torch.set_num_threads(1)
    case = _gpt_case(batch=16)  # activations, not the retained gradients, dominate the peak
    peak = measure_peak(case)
    budget_mb = peak * 0.5 / MIB
    session = OffloadSession(OffloadConfig(max_resident_activation_mb=budget_mb))
    model = case.build()
    for step in range(3):
        with session:
            model.loss(*case.inputs(step)).backward()
        model.zero_grad(set_to_none=True)
    report = session.last_report
    assert report is not None and report.phase == "replay"
    assert report.bytes_d2h > 0
    assert report.peak_resident_bytes <= report.budget_bytes * 1.05, str(report)
