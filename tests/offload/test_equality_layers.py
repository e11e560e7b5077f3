"""Bitwise equality with and without offload for the layers and op patterns users rely on."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from hyperpar.offload import skip_offload
from tests.offload.equality_harness import Case, run_equality


def _gen(step: int) -> torch.Generator:
    return torch.Generator().manual_seed(100 + step)


def _x(*shape: int) -> callable:
    return lambda step: (torch.randn(*shape, generator=_gen(step)),)


class InPlace(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        h = h * 1.5
        h.relu_()  # relu_ saves its result: nothing may write h after this
        g = h * 2.0
        g.add_(torch.ones_like(g))
        g = g.masked_fill_(g > 2.0, 0.5)
        return self.fc2(g)


class Views(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 48)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b, c = self.fc(x).chunk(3, dim=-1)
        t = a.transpose(0, 1).contiguous().view(-1) * b.transpose(0, 1).reshape(-1)
        return t.view(16, -1).sum(0) * c.mean()


class Tuples(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        values, _ = h.max(dim=-1)
        top, _ = torch.topk(h, 4, dim=-1)
        first, second = h.split(8, dim=-1)
        return values.sum() + top.sum() + (first * second).sum()


class Lists(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        cat = torch.cat([h, h.sin(), x], dim=-1)
        stacked = torch.stack([h, h.cos()], dim=0)
        return cat.pow(2).sum() + stacked.tanh().sum()


@skip_offload
def _branchy(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    # Data-dependent control flow: the number of inner ops changes with the data.
    y = h @ w
    if float(y.detach().sum()) > 0:
        y = y.relu() * 2.0
    else:
        y = y.exp().clamp(max=10.0) + y.sigmoid()
    for _ in range(int(h.detach().abs().sum()) % 3):
        y = y + 0.1
    return y


class Opaque(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.w = nn.Parameter(torch.randn(16, 16) * 0.1)
        self.out = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(_branchy(self.fc(x).tanh(), self.w)).square().sum()


class OpaqueModule(nn.Module):
    """A whole sub-module as the region, fed a tensor that does not require grad."""

    def __init__(self) -> None:
        super().__init__()
        self.block = skip_offload(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16)))
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(x).sigmoid())


class OpaqueClosure(nn.Module):
    """The region reads an activation it captured (not an argument), like a mask or a rotary cache."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = (x > 0).float() * 0.5  # an activation without grad
        h = self.fc2(self.fc1(x * mask).tanh()).relu()
        h = h + mask  # its last traced access; the region below reads it again
        h = self.fc2(h.sin()).cos()
        return self.fc3(skip_offload(lambda y: y * mask)(h))


class BufferSwap(nn.Module):
    """A forward pre-hook replaces a buffer inside the step (the new one outlives the step)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.register_buffer("scale", torch.ones(16))
        self.register_forward_pre_hook(lambda mod, args: setattr(mod, "scale", mod.scale * 0.9 + 0.2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.fc(x) * self.scale).tanh()


class Checkpointed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = checkpoint(self.block, x, use_reentrant=False)
        return self.head(h.relu())


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(16, 48)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).view(2, 8, 3, 2, 8).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class Recurrent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gru = nn.GRU(8, 16, num_layers=2, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, h = self.gru(x)
        return out.sum() + h.sum()


class SelfAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mha = nn.MultiheadAttention(16, 2, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, weights = self.mha(x, x, x, need_weights=True)
        return out.sum() + weights.sum()


CASES = [
    Case("mlp", lambda: nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.Tanh(),
                                      nn.Linear(64, 4)), _x(32, 16)),
    Case("conv2d", lambda: nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 4, 3)),
         _x(4, 3, 12, 12)),
    Case("batchnorm", lambda: nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(),
                                            nn.Flatten(), nn.Linear(8 * 10 * 10, 4), nn.BatchNorm1d(4)),
         _x(6, 3, 12, 12)),
    Case("layernorm", lambda: nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.GELU(), nn.Linear(32, 4)),
         _x(8, 10, 16)),
    Case("groupnorm", lambda: nn.Sequential(nn.Conv2d(4, 8, 3), nn.GroupNorm(2, 8), nn.SiLU()),
         _x(4, 4, 10, 10)),
    Case("embedding", lambda: nn.Sequential(nn.Embedding(50, 16), nn.Linear(16, 8)),
         lambda step: (torch.randint(0, 50, (8, 12), generator=_gen(step)),)),
    Case("gru", Recurrent, _x(4, 7, 8)),
    Case("multihead_attention", SelfAttention, _x(3, 9, 16)),
    Case("sdpa", Attention, _x(2, 8, 16)),
    Case("dropout", lambda: nn.Sequential(nn.Linear(16, 64), nn.Dropout(0.3), nn.ReLU(), nn.Linear(64, 4),
                                          nn.Dropout(0.2)), _x(16, 16)),
    Case("inplace", InPlace, _x(16, 16)),
    Case("views", Views, _x(16, 16)),
    Case("tuples", Tuples, _x(16, 16)),
    Case("tensor_lists", Lists, _x(16, 16)),
    Case("skip_offload_branchy", Opaque, _x(16, 16)),
    Case("skip_offload_module", OpaqueModule, _x(16, 16)),
    Case("skip_offload_closure", OpaqueClosure, _x(16, 16)),
    Case("buffer_swapped_by_pre_hook", BufferSwap, _x(16, 16)),
    Case("checkpoint", Checkpointed, _x(16, 16)),
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_bitwise_equal_at_every_budget(case: Case) -> None:
    torch.set_num_threads(1)
    run_equality(case)
