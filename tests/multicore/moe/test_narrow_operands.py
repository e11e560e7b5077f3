"""The ``gemm_dtype`` opt-in's memory-saving helpers give exactly the values of the plain
formula computed wide and cast once: blocks change how much is held, never a bit."""

from __future__ import annotations

import pytest
import torch

from hyperpar.multicore.moe.grouped_gemm import group_offsets, grouped_weight_grad, weight_grad_as
from hyperpar.multicore.moe.swiglu import swiglu, swiglu_as, swiglu_backward, swiglu_backward_as

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
@pytest.mark.parametrize("block_rows", [None, 1, 8, 100])
def test_swiglu_in_row_blocks_equals_wide_then_cast(limit: float | None, block_rows: int | None) -> None:
    torch.manual_seed(2)
    pre = torch.randn(37, 24).to(BF16)
    got = swiglu_as(pre, torch.float32, limit, block_rows)
    assert got.dtype == BF16 and torch.equal(got, swiglu(pre.float(), limit).to(BF16))
    wide = pre.float()
    assert torch.equal(swiglu_as(wide, torch.float32, limit, block_rows), swiglu(wide, limit))  # no blocks


@pytest.mark.parametrize("limit", [None, 0.7])
def test_swiglu_backward_in_row_blocks_equals_wide_then_cast(limit: float | None) -> None:
    torch.manual_seed(0)
    pre = torch.randn(37, 24).to(BF16)
    grad = torch.randn(37, 12).to(BF16)
    scale = torch.rand(37)
    want_grad, want_act, want_scale_grad = swiglu_backward(pre.float(), grad.float(), limit, scale,
                                                           want_activation=True, want_scale_grad=True)
    assert want_act is not None and want_scale_grad is not None
    kept = grad.clone()
    got_grad, got_act, got_scale_grad = swiglu_backward_as(pre, grad, torch.float32, limit, scale, True, True,
                                                           block_rows=8)
    assert torch.equal(grad, kept)  # the narrow input is not scaled in place (only a wide copy is)
    assert got_act is not None and got_grad.dtype == got_act.dtype == BF16
    assert got_scale_grad is not None and got_scale_grad.dtype == torch.float32
    assert torch.equal(got_grad, want_grad.to(BF16)) and torch.equal(got_act, want_act.to(BF16))
    assert torch.equal(got_scale_grad, want_scale_grad)
    no_act = swiglu_backward_as(pre, grad, torch.float32, limit, scale, block_rows=8)
    assert no_act[1] is None and no_act[2] is None and torch.equal(no_act[0], got_grad)


@pytest.mark.parametrize("limit", [None, 0.7])
def test_swiglu_backward_with_a_row_scale_is_autograd_of_the_scaled_formula(limit: float | None) -> None:
    """The route weight applied inside: pre's gradient is autograd's for ``scale * swiglu(pre)``,
    the scale's gradient ``<grad, swiglu(pre)>``, and the activation returned is ``scale * act``."""
    torch.manual_seed(1)
    pre = torch.randn(29, 20, dtype=torch.float64, requires_grad=True)
    scale = torch.rand(29, dtype=torch.float64, requires_grad=True)
    grad = torch.randn(29, 10, dtype=torch.float64)
    act = swiglu(pre, limit)
    (act * scale.unsqueeze(1)).backward(grad)
    got_grad, got_act, got_scale_grad = swiglu_backward(pre.detach(), grad.clone(), limit, scale.detach(),
                                                        want_activation=True, want_scale_grad=True)
    assert got_act is not None and got_scale_grad is not None
    assert torch.allclose(got_grad, pre.grad, rtol=0, atol=1e-12)
    assert torch.allclose(got_scale_grad, scale.grad, rtol=0, atol=1e-12)
    assert torch.allclose(got_act, act.detach() * scale.detach().unsqueeze(1), rtol=0, atol=1e-12)
