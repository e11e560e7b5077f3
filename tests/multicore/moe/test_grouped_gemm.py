"""Grouped GEMM: the fused path and the loop give the same numbers, empty groups give zeros."""

from __future__ import annotations

import pytest
import torch

from hyperpar.multicore.moe import grouped_gemm
from hyperpar.multicore.moe.grouped_gemm import (
    group_offsets,
    grouped_mm,
    grouped_mm_cast,
    grouped_weight_grad,
    set_grouped_mm_enabled,
)

COUNTS = [5, 0, 11, 3]


def _operands(dtype: torch.dtype, k: int = 16, n: int = 8) -> tuple[torch.Tensor, ...]:
    torch.manual_seed(0)
    rows = torch.randn(sum(COUNTS), k, dtype=dtype)
    weight = torch.randn(len(COUNTS), k, n, dtype=dtype)
    grad = torch.randn(sum(COUNTS), n, dtype=dtype)
    return rows, weight, grad


def _by_hand(rows: torch.Tensor, weight: torch.Tensor, grad: torch.Tensor) -> tuple[torch.Tensor, ...]:
    outs, dws, start = [], [], 0
    for g, count in enumerate(COUNTS):
        outs.append(rows[start:start + count] @ weight[g])
        dws.append(rows[start:start + count].t() @ grad[start:start + count])
        start += count
    return torch.cat(outs), torch.stack(dws)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("fused", [True, False])
def test_matches_per_group_matmul(dtype: torch.dtype, fused: bool) -> None:
    rows, weight, grad = _operands(dtype)
    offsets = group_offsets(COUNTS, rows.device)
    set_grouped_mm_enabled(fused)
    try:
        out = grouped_mm(rows, weight, COUNTS, offsets)
        dw = grouped_weight_grad(rows, grad, COUNTS, offsets)
        dx = grouped_mm(grad, weight.transpose(1, 2), COUNTS, offsets)
    finally:
        set_grouped_mm_enabled(True)
    want_out, want_dw = _by_hand(rows, weight, grad)
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(out, want_out, rtol=tol, atol=tol)
    torch.testing.assert_close(dw, want_dw, rtol=tol, atol=tol)
    assert dx.shape == rows.shape
    assert torch.equal(dw[1], torch.zeros_like(dw[1]))  # the group without rows: exact zeros


@pytest.mark.parametrize("transpose", [False, True])
def test_cast_per_group_equals_casting_the_stack_first(transpose: bool) -> None:
    """The opt-in's per-expert cast into a reused buffer: bitwise what a cast of the whole
    float32 stack followed by the grouped GEMM gives (empty group included)."""
    torch.set_num_threads(1)
    rows, weight, _ = _operands(torch.float32, k=32, n=48)
    rows = rows.to(torch.bfloat16) if not transpose else torch.randn(sum(COUNTS), 48).to(torch.bfloat16)
    narrow = weight.to(torch.bfloat16)
    offsets = group_offsets(COUNTS, rows.device)
    want = grouped_mm(rows, narrow.transpose(1, 2) if transpose else narrow, COUNTS, offsets)
    got = grouped_mm_cast(rows, weight, COUNTS, transpose)
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    assert torch.equal(got, want)


def test_unaligned_shapes_fall_back_to_the_loop() -> None:
    rows, weight, grad = _operands(torch.float32, k=5, n=3)  # strides not 16-byte aligned
    offsets = group_offsets(COUNTS, rows.device)
    want_out, want_dw = _by_hand(rows, weight, grad)
    torch.testing.assert_close(grouped_mm(rows, weight, COUNTS, offsets), want_out)
    torch.testing.assert_close(grouped_weight_grad(rows, grad, COUNTS, offsets), want_dw)


def test_no_rows_at_all() -> None:
    rows = torch.randn(0, 16)
    weight = torch.randn(3, 16, 8)
    offsets = group_offsets([0, 0, 0], rows.device)
    assert grouped_mm(rows, weight, [0, 0, 0], offsets).shape == (0, 8)
    weight_grad = grouped_weight_grad(rows, torch.randn(0, 8), [0, 0, 0], offsets)
    assert torch.equal(weight_grad, torch.zeros(3, 16, 8))


def test_fused_path_is_taken_when_it_applies(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[torch.dtype] = []
    real = torch._grouped_mm

    def counting(*args: object, **kwargs: object) -> torch.Tensor:
        calls.append(args[0].dtype)  # type: ignore[union-attr]
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "_grouped_mm", counting)
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        rows, weight, grad = _operands(dtype)
        offsets = group_offsets(COUNTS, rows.device)
        grouped_mm(rows, weight, COUNTS, offsets)
        grouped_weight_grad(rows, grad, COUNTS, offsets)
    assert calls == [torch.float32] * 2 + [torch.bfloat16] * 2  # float64 has no fused kernel: loop


def _raising(exc: BaseException, calls: list[torch.Size]) -> object:
    def fail(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        calls.append(b.shape)
        raise exc
    return fail


@pytest.mark.parametrize("exc", [torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB"),
                                 RuntimeError("DefaultCPUAllocator: not enough memory: you tried to "
                                              "allocate 1 GiB (out of memory)"),
                                 RuntimeError("cuBLAS status execution failed")])
def test_a_failing_fused_call_propagates(monkeypatch: pytest.MonkeyPatch, exc: BaseException) -> None:
    monkeypatch.setattr(grouped_gemm, "_disabled", set())
    calls: list[torch.Size] = []
    monkeypatch.setattr(torch, "_grouped_mm", _raising(exc, calls))
    rows, weight, _ = _operands(torch.float32)
    offsets = group_offsets(COUNTS, rows.device)
    for _ in range(2):  # the failure disables nothing: the next call tries the fused path again
        with pytest.raises(type(exc), match=str(exc)[:12]):
            grouped_mm(rows, weight, COUNTS, offsets)
    assert len(calls) == 2 and not grouped_gemm._disabled


@pytest.mark.parametrize("exc", [NotImplementedError("_grouped_mm: not implemented for 'Float'"),
                                 RuntimeError("grouped gemm is not supported on this device")])
def test_unsupported_disables_only_that_signature(monkeypatch: pytest.MonkeyPatch,
                                                  exc: BaseException) -> None:
    monkeypatch.setattr(grouped_gemm, "_disabled", set())
    real = torch._grouped_mm
    calls: list[torch.Size] = []
    refuse = _raising(exc, calls)

    def refuses_wide_float32(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        if a.dtype == torch.float32 and b.shape[-1] == 8:
            return refuse(a, b, offs)  # type: ignore[operator]
        calls.append(b.shape)
        return real(a, b, offs=offs)

    monkeypatch.setattr(torch, "_grouped_mm", refuses_wide_float32)
    rows, weight, grad = _operands(torch.float32)
    offsets = group_offsets(COUNTS, rows.device)
    want_out, _ = _by_hand(rows, weight, grad)
    for _ in range(2):  # the loop answers; the refused signature is not tried a second time
        torch.testing.assert_close(grouped_mm(rows, weight, COUNTS, offsets), want_out)
    assert calls == [weight.shape]
    other = torch.randn(len(COUNTS), 16, 16)  # another shape, same dtype: still fused
    grouped_mm(rows, other, COUNTS, offsets)
    bf16_rows, bf16_weight, _ = _operands(torch.bfloat16)  # same shape, another dtype: still fused
    grouped_mm(bf16_rows, bf16_weight, COUNTS, offsets)
    assert calls == [weight.shape, other.shape, bf16_weight.shape]
