"""The ``gemm_dtype`` opt-in's memory-saving helpers give exactly the values of the plain
formula computed wide and cast once: blocks change how much is held, never a bit."""

from __future__ import annotations

import pytest
import torch

from hyperpar.multicore.moe.grouped_gemm import group_offsets, grouped_weight_grad, weight_grad_as
from hyperpar.multicore.moe.swiglu import swiglu_backward, swiglu_backward_as

BF16 = torch.bfloat16


@pytest.mark.parametrize("counts", [[5, 0, 11, 3, 7, 0], [0, 0, 4], [9]])
def test_weight_grad_in_blocks_equals_one_call_cast(counts: list[int]) -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    rows = torch.randn(sum(counts), 32, dtype=BF16)
    grad = torch.randn(sum(counts), 16, dtype=BF16)
    offsets = group_offsets(counts, rows.device)
    whole = grouped_weight_grad(rows, grad, counts, offsets)
    blocked = weight_grad_as(torch.float32, rows, grad, counts, offsets)
    assert blocked.dtype == torch.float32
    assert torch.equal(blocked, whole.float())
    assert torch.equal(weight_grad_as(BF16, rows, grad, counts, offsets), whole)  # same dtype: one call


@pytest.mark.parametrize("limit", [None, 0.7])
def test_swiglu_backward_in_row_blocks_equals_wide_then_cast(limit: float | None) -> None:
    torch.manual_seed(0)
    pre = torch.randn(37, 24).to(BF16)
    grad = torch.randn(37, 12).to(BF16)
    want_grad, want_act = swiglu_backward(pre.float(), grad.float(), limit, want_activation=True)
    assert want_act is not None
    got_grad, got_act = swiglu_backward_as(pre, grad, torch.float32, limit, True, block_rows=8)
    assert got_act is not None and got_grad.dtype == got_act.dtype == BF16
    assert torch.equal(got_grad, want_grad.to(BF16)) and torch.equal(got_act, want_act.to(BF16))
    no_act = swiglu_backward_as(pre, grad, torch.float32, limit, block_rows=8)
    assert no_act[1] is None and torch.equal(no_act[0], got_grad)
