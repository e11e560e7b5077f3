"""The Hugging Face Mixtral block with MoeExperts gives the original output at ep_size 1 and 2,
through the example script itself."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

from tests.rank_harness import run_ranks

pytest.importorskip("transformers")
EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "moe_hf_mixtral.py"


def _example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("moe_hf_mixtral", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run_example(rank: int, world: int) -> float:
    return _example().main()


def test_single_rank() -> None:
    assert _example().main() <= 1e-6


def test_two_expert_parallel_ranks() -> None:
    for rank, difference in run_ranks(_run_example, 2, timeout=90).items():
        assert difference <= 1e-6, f"rank {rank}: {difference}"


def test_qwen2_moe_block_single_rank() -> None:
    import torch
    from transformers import Qwen2MoeConfig
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock

    from hyperpar.multicore.moe.hf import replace_hf_moe_experts

    torch.manual_seed(0)
    config = Qwen2MoeConfig(hidden_size=32, moe_intermediate_size=16, shared_expert_intermediate_size=16,
                            num_experts=4, num_experts_per_tok=2, norm_topk_prob=True)
    block = Qwen2MoeSparseMoeBlock(config)
    for parameter in block.parameters():
        torch.nn.init.normal_(parameter, std=0.2)
    x = torch.randn(2, 6, 32)
    with torch.no_grad():
        expected = block(x)
        experts = replace_hf_moe_experts(block, local_num_tokens=12)
        got = block(x)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    experts.close()


def test_transformers_4_layout_is_rejected() -> None:
    import torch

    from hyperpar.multicore.moe.hf import replace_hf_moe_experts

    block = torch.nn.Module()
    block.experts = torch.nn.ModuleList([torch.nn.Linear(4, 4)])
    with pytest.raises(TypeError, match=r"transformers 4\.x layout"):
        replace_hf_moe_experts(block, local_num_tokens=4, top_k=1)
