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
