"""Higher-order operators inside a session: each call is one opaque op with its tensor inputs
(paged in before it runs), bitwise equal to plain PyTorch at every budget."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.attention.flex_attention import create_block_mask, flex_attention
from torch.utils.checkpoint import checkpoint

from hyperpar.offload import OffloadConfig, OffloadSession
from tests.offload.equality_harness import Case, run_equality

SEQ, HEADS, DIM = 32, 2, 8


@pytest.fixture(autouse=True)
def _one_thread() -> Any:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        yield
    torch.set_num_threads(threads)


def _x(step: int) -> tuple[torch.Tensor]:
    return (torch.randn(2, SEQ, HEADS * DIM, generator=torch.Generator().manual_seed(step)),)


def _causal(b: Any, h: Any, q: Any, k: Any) -> Any:
    return q >= k


class FlexHead(nn.Module):
    """flex_attention with a score_mod that captures a tensor and a block mask; the trainable
    layers sit before and after it (flex_attention has no backward on CPU)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(HEADS * DIM, HEADS * DIM)
        self.register_buffer("bias", torch.randn(SEQ, SEQ))
        self.mask = create_block_mask(_causal, None, None, SEQ, SEQ, device="cpu", BLOCK_SIZE=16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.bias

        def score_mod(s: Any, b: Any, h: Any, q: Any, k: Any) -> Any:
            return s + bias[q, k]

        qkv = torch.tanh(x).view(2, SEQ, HEADS, DIM).transpose(1, 2)  # no grad: the input's
        att = flex_attention(qkv, qkv * 0.5, qkv.sin(), score_mod=score_mod, block_mask=self.mask)
        return self.proj(att.transpose(1, 2).reshape(2, SEQ, HEADS * DIM)).relu()


def test_flex_attention_is_one_op_and_bitwise_equal() -> None:
    reports = run_equality(Case("flex_attention", FlexHead, _x))
    session = OffloadSession(OffloadConfig(max_resident_activation_mb=0))
    with session:
        FlexHead()(*_x(0)).sum().backward()
    assert [op.name for op in session.trace.ops].count("hop.flex_attention") == 1
    # warmup evicts around it (a replay plans for the floor, and the floor is the op itself)
    assert reports[0.0][0].bytes_d2h > 0


def test_flex_attention_backward_operator_is_one_op_and_bitwise_equal() -> None:
    """The public API refuses gradients on CPU; the operator itself has a CPU backward, which
    is what accelerators run: forward and backward are one op each."""
    from torch._higher_order_ops.flex_attention import flex_attention as flex_op

    mask = create_block_mask(_causal, None, None, SEQ, SEQ, device="cpu", BLOCK_SIZE=16)

    class Attention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.qkv = nn.Linear(HEADS * DIM, 3 * HEADS * DIM)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            q, k, v = self.qkv(x).view(2, SEQ, 3, HEADS, DIM).permute(2, 0, 3, 1, 4)
            out = flex_op(q, k, v, lambda s, b, h, qi, ki: s * 0.5, mask.as_tuple(), DIM ** -0.5, {})[0]
            return out.square()

    run_equality(Case("flex_attention operator", Attention, _x))
    session = OffloadSession(OffloadConfig(max_resident_activation_mb=0))
    with session:
        Attention()(*_x(0)).sum().backward()
    names = [op.name for op in session.trace.ops]
    assert names.count("hop.flex_attention") == 1 and names.count("hop.flex_attention_backward") == 1


class CondBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(x)
        return torch.cond(h.sum() > 0, lambda t: self.a(t).sin(), lambda t: self.b(t).cos(), (h,))


def test_cond_is_one_op_forward_and_backward_and_bitwise_equal() -> None:
    def inputs(step: int) -> tuple[torch.Tensor]:  # the branch taken changes with the step
        return (torch.randn(8, 16, generator=torch.Generator().manual_seed(step)) + (-1) ** step,)

    run_equality(Case("cond", CondBlock, inputs))
    session = OffloadSession(OffloadConfig(max_resident_activation_mb=0))
    with session:
        CondBlock()(*inputs(0)).sum().backward()
    assert [op.name for op in session.trace.ops].count("hop.cond") == 2


class Checkpointed(nn.Module):
    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.reentrant = reentrant
        self.block = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Dropout(0.1), nn.Linear(32, 16))
        self.head = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.head(x))
        h = checkpoint(self.block, h, use_reentrant=self.reentrant)
        return self.head(h).square()


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_checkpoint_is_bitwise_equal(reentrant: bool) -> None:
    def inputs(step: int) -> tuple[torch.Tensor]:
        return (torch.randn(8, 16, generator=torch.Generator().manual_seed(step)),)

    case = Case(f"checkpoint(use_reentrant={reentrant})", lambda: Checkpointed(reentrant), inputs)
    reports = run_equality(case)
    assert reports[0.0][-1].bytes_d2h > 0
