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


def _saved_and_kept(rank: int, world: int) -> dict[str, Any]:
    """Per layer: dtypes of what autograd saved (through saved_tensors_hooks) and the
    workspace bytes kept, for the same weights and routing."""
    torch.manual_seed(0)
    args = dict(local_num_tokens=32, hidden_size=16, intermediate_size=8, num_experts=4, top_k=2,
                ep_size=world)
    strict = MoeExperts(**args)
    opt_in = MoeExperts(**args, gemm_dtype=BF16)
    opt_in.load_state_dict(strict.state_dict())
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(32, 16, generator=gen, requires_grad=True)
    weights, ids = torch.softmax(torch.randn(32, 4, generator=gen), -1).topk(2, -1)
    weights.requires_grad_()
    out: dict[str, Any] = {}
    for name, layer in (("strict", strict), ("opt_in", opt_in)):
        saved: list[str] = []

        def pack(t: torch.Tensor, into: list[str] = saved) -> torch.Tensor:
            into.append(str(t.dtype))
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            y = layer(x, ids, weights)
        y.square().sum().backward()
        out[name] = {"saved": saved, "kept": layer.workspace_bytes, "out_dtype": str(y.dtype)}
        layer.close()
    return out


def test_opt_in_saves_and_sends_rows_in_the_gemm_dtype() -> None:
    """The opt-in's rows and pre-activations are bf16 values anyway: they are
    saved as bf16 (visible to saved_tensors_hooks) and travel in a bf16 workspace half the size."""
    for rank, out in run_ranks(_saved_and_kept, 2, timeout=90).items():
        strict, opt_in = out["strict"], out["opt_in"]
        assert opt_in["out_dtype"] == "torch.float32", rank
        assert opt_in["saved"].count("torch.bfloat16") == 2, (rank, opt_in)  # rows, pre-activations
        assert "torch.bfloat16" not in strict["saved"] and len(strict["saved"]) == len(opt_in["saved"]), out
        # half the rows' bytes; the route weights packed beside the gradient rows are float32 in
        # both (a row per 8 at this tiny width, H=16 in bf16; a few per thousand at real widths)
        assert 0 < opt_in["kept"] <= 0.6 * strict["kept"], (rank, out)
