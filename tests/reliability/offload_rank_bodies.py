"""Rank bodies for offload with collectives: a small MoE model trained plain and under an
OffloadSession side by side, and all_gather inside a session (importable by spawned ranks)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from hyperpar.multicore.moe import MoeExperts
from hyperpar.offload import OffloadConfig, OffloadSession
from tests.reliability.bitwise import same_bits

H, E, K, T = 16, 4, 2, 6


class MoeNet(torch.nn.Module):
    def __init__(self, ep_size: int) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(H, H)
        self.router = torch.nn.Linear(H, E)
        self.experts = MoeExperts(local_num_tokens=8, hidden_size=H, intermediate_size=8, num_experts=E,
                                  top_k=K, ep_size=ep_size)
        self.out = torch.nn.Linear(H, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        weights, ids = self.router(h).softmax(-1).topk(K, dim=-1)
        return self.out(self.experts(h, ids, weights) + h).square().sum()


def offload_matches_plain(rank: int, world: int, engine: str, budget: int, steps: int = 4) -> dict[str, Any]:
    """Every step's loss and gradients bitwise equal with and without the session."""
    ep = world if dist.is_initialized() else 1
    torch.manual_seed(0)
    plain = MoeNet(ep)
    torch.manual_seed(0)
    off = MoeNet(ep)
    session = OffloadSession(OffloadConfig(max_resident_activation_mb=budget / (1 << 20), copy_engine=engine))
    gen = torch.Generator().manual_seed(rank)
    differs: list[str] = []
    moved = 0
    for step in range(steps):
        x = torch.randn(T, H, generator=gen)
        loss_a = plain(x)
        loss_a.backward()
        with session:
            loss_b = off(x)
            loss_b.backward()
        assert session.last_report is not None
        moved += session.last_report.bytes_d2h
        if not same_bits(loss_a.detach(), loss_b.detach()):
            differs.append(f"step {step}: loss")
        for (name, pa), pb in zip(plain.named_parameters(), off.parameters(), strict=True):
            if not same_bits(pa.grad, pb.grad):
                differs.append(f"step {step}: grad of {name}")
        plain.zero_grad(set_to_none=True)
        off.zero_grad(set_to_none=True)
    plain.experts.close()
    off.experts.close()
    return {"differs": differs, "moved": moved, "phase": session.phase,
            "held_after_clean_steps": session.tracked_storages()}


def all_gather_in_session(rank: int, world: int, budget: int) -> list[float]:
    """``dist.all_gather`` into fresh tensors inside a session at ``budget`` bytes."""
    session = OffloadSession(OffloadConfig(max_resident_activation_mb=budget / (1 << 20)))
    with session:
        mine = torch.full((4096,), float(rank + 1))
        gathered = [torch.empty(4096) for _ in range(world)]
        dist.all_gather(gathered, mine)
        sums = [float(t.sum()) for t in gathered]
    return sums


def async_all_gather_in_session(rank: int, world: int, budget: int, steps: int = 3) -> list[list[float]]:
    """An async ``all_gather`` still in flight while later ops push the step over ``budget``."""
    session = OffloadSession(OffloadConfig(max_resident_activation_mb=budget / (1 << 20)))
    sums = []
    for _ in range(steps):
        with session:
            mine = torch.full((1 << 16,), float(rank + 1))
            gathered = [torch.empty(1 << 16) for _ in range(world)]
            work = dist.all_gather(gathered, mine, async_op=True)
            later = [torch.randn(1 << 16) * 2.0 for _ in range(8)]  # over budget: older storages leave
            work.wait()
            sums.append([float(t.sum()) for t in gathered])
            del later
    return sums
