"""The opt-in ``gemm_dtype=torch.bfloat16``: float32 inputs, outputs and gradients, expert GEMMs in
bf16 (as torchtitan's GroupedExperts computes), within a bf16 tolerance of the dense float32
reference on 1 and 2 ranks; the default stays strict float32 (test_matches_reference)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from hyperpar.multicore import MoeExperts
from tests.multicore.moe.scenarios import compare_with_reference
from tests.multicore.moe.test_matches_reference import TOLERANCE, _check
from tests.rank_harness import run_ranks

BF16 = torch.bfloat16
CASES: list[tuple[Any, ...]] = [("uniform", 1, None, torch.float32, None, BF16),
                                ("empty_experts", 2, 0.4, torch.float32, None, BF16),
                                ("full/single_destination", 1, None, torch.float32, 1.0, BF16)]  # waves


def _check_opt_in(report: dict[str, Any], label: str) -> None:
    _check(report, label)
    for case, diffs in report.items():
        assert diffs["output_dtype"] == "torch.float32", case
        assert diffs["grad_dtypes"] == ["torch.float32"] * 3, case
        # bf16 arithmetic, not float32 under another name: the output moves beyond float32's tolerance
        assert diffs["output"] > TOLERANCE["torch.float32"], f"{label} {case}: {diffs['output']}"


def test_one_rank_bf16_gemms_match_the_float32_reference() -> None:
    _check_opt_in(compare_with_reference(0, 1, CASES), "world 1")


def test_two_ranks_bf16_gemms_match_the_float32_reference() -> None:
    for rank, report in run_ranks(compare_with_reference, 2, args=(CASES,), timeout=90).items():
        _check_opt_in(report, f"world 2 rank {rank}")


@pytest.mark.parametrize("bad", [torch.float32, torch.float64, "bfloat16"])
def test_gemm_dtype_is_validated(bad: Any) -> None:
    with pytest.raises(ValueError, match=r"gemm_dtype must be None, torch\.bfloat16 or torch\.float16"):
        MoeExperts(local_num_tokens=4, hidden_size=8, intermediate_size=8, num_experts=2, top_k=1,
                   gemm_dtype=bad)
