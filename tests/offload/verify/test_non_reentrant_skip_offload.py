"""Issue 11, item 5 of its build list: a ``skip_offload`` region's backward runs inside the one
backward pass. On main it called ``torch.autograd.backward`` from inside ``backward``
(reentrant), so ``torch.autograd.grad`` through a region filled ``param.grad`` of the region's
parameters (plain PyTorch leaves them None), as ``torch.utils.checkpoint`` documents for
``use_reentrant=True``. Outside a session ``skip_offload`` just calls the function, so the
plain run below is the undecorated model."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from hyperpar.offload import skip_offload
from tests.offload.verify.lockstep import Lockstep, measured_peak, session_at
from tests.reliability.bitwise import same_bits
from tests.reliability.offload_rank_bodies import MoeNet

ROWS, WIDTH = 16, 8
BUDGETS = ("0", "peak")


@skip_offload
def _region(mid: nn.Linear, h: torch.Tensor) -> torch.Tensor:
    """Module-level so that a deep copy of the model calls it with its own ``mid``."""
    return torch.tanh(mid(h)) * h.sigmoid()


class RegionNet(nn.Module):
    """input -> tanh(Linear) -> region (a Linear inside) -> Linear -> loss. ``shared``: the
    region's input also feeds the loss outside the region."""

    def __init__(self, shared: bool = False) -> None:
        super().__init__()
        self.inp, self.mid, self.out = nn.Linear(WIDTH, 16), nn.Linear(16, 16), nn.Linear(16, 1)
        self.shared = shared

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        u = _region(self.mid, h)
        if self.shared:
            u = u + h * 0.5
        return self.out(u).square().sum()


def _budget(name: str, build: type[nn.Module] = RegionNet) -> float:
    return 0.0 if name == "0" else 2.0 * measured_peak(build, (torch.randn(ROWS, WIDTH),))


def _inputs(step: int) -> torch.Tensor:
    return torch.randn(ROWS, WIDTH, generator=torch.Generator().manual_seed(step))


@pytest.mark.parametrize("budget", BUDGETS)
def test_autograd_grad_through_a_region_touches_no_grad_attribute(budget: str) -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    plain = RegionNet()
    off = copy.deepcopy(plain)
    session = session_at(_budget(budget))
    for step in range(3):  # warmup and two replays
        x = _inputs(step)
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        want = torch.autograd.grad(plain(xa), [xa, plain.inp.weight])
        with session:
            got = torch.autograd.grad(off(xb), [xb, off.inp.weight])
        for i, (a, b) in enumerate(zip(want, got, strict=True)):
            assert same_bits(a, b), f"step {step}: gradient {i} differs from plain PyTorch"
        filled = [name for name, p in off.named_parameters() if p.grad is not None]
        assert filled == [], f"step {step}: autograd.grad filled .grad of {filled} (plain PyTorch fills none)"
        assert xb.grad is None and all(p.grad is None for p in plain.parameters())


@pytest.mark.parametrize("budget", BUDGETS)
def test_backward_through_a_region_is_bitwise_plain(budget: str) -> None:
    torch.set_num_threads(1)
    run = Lockstep(RegionNet, session_at(_budget(budget)))
    for step in range(3):
        run.step(_inputs(step))
    assert run.reports[-1].phase == "replay" and run.reports[-1].diverged_at is None


@pytest.mark.parametrize("budget", BUDGETS)
def test_double_backward_through_a_region(budget: str) -> None:
    """``create_graph=True``: the gradient through the region is itself differentiable, as in
    plain PyTorch (a gradient penalty)."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    plain = RegionNet()
    off = copy.deepcopy(plain)
    session = session_at(_budget(budget))
    for step in range(3):
        x = _inputs(step)
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        (ga,) = torch.autograd.grad(plain(xa), xa, create_graph=True)
        ga.square().sum().backward()
        with session:
            (gb,) = torch.autograd.grad(off(xb), xb, create_graph=True)
            gb.square().sum().backward()
        assert same_bits(ga.detach(), gb.detach()), f"step {step}: first-order gradient"
        assert same_bits(xa.grad, xb.grad), f"step {step}: second-order gradient of the input"
        for (name, pa), pb in zip(plain.named_parameters(), off.parameters(), strict=True):
            assert same_bits(pa.grad, pb.grad), f"step {step}: second-order gradient of {name}"
        plain.zero_grad(set_to_none=True)
        off.zero_grad(set_to_none=True)


@pytest.mark.parametrize("budget", BUDGETS)
def test_region_input_also_used_outside_the_region(budget: str) -> None:
    """The region's input ``h`` also feeds the loss directly: its gradient is the sum of the
    region's part and the outside part, in plain PyTorch's order (on main the region's part
    came first: last-bit differences; tests/reliability/test_random_programs.py had it as a
    strict xfail, test_opaque_input_shared_outside_the_region)."""
    torch.set_num_threads(1)

    def build() -> RegionNet:
        return RegionNet(shared=True)

    run = Lockstep(build, session_at(_budget(budget, build)))  # type: ignore[arg-type]
    for step in range(4):
        run.step(_inputs(step))


def test_autograd_grad_through_moe_experts_touches_no_grad_attribute() -> None:
    """Every ``MoeExperts`` call inside a session is a region."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    plain = MoeNet(1)
    off = copy.deepcopy(plain)
    session = session_at(0)
    try:
        for step in range(2):
            x = torch.randn(6, 16, generator=torch.Generator().manual_seed(step))
            xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
            (want,) = torch.autograd.grad(plain(xa), xa)
            with session:
                (got,) = torch.autograd.grad(off(xb), xb)
            assert same_bits(want, got), f"step {step}"
            filled = [name for name, p in off.named_parameters() if p.grad is not None]
            assert filled == [], f"step {step}: autograd.grad filled .grad of {filled}"
    finally:
        plain.experts.close()
        off.experts.close()
