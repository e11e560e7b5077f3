"""One MoeExperts forward reads device data on the host once (the gathered route counts, which
carry the ``topk_ids`` range check too) and copies to the device at most once, without blocking,
whatever the chunks, waves and optional ``tokens_per_expert``; its backward neither reads nor
copies (issue 13). Counted on CPU by ``host_transfers.TransferCounter`` (what it counts is in
its docstring)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from hyperpar.multicore import MoeExperts
from tests.multicore.moe.host_transfers import counting_transfers
from tests.rank_harness import run_ranks

H, INTER, E, K, T = 16, 8, 8, 2, 12
# name -> (overlap_chunks, expert_capacity_factor, skewed routing, pass tokens_per_expert)
CASES: dict[str, tuple[int, float | None, bool, bool]] = {
    "one chunk": (1, None, False, False),
    "three chunks": (3, None, False, False),
    "tokens_per_expert": (1, None, False, True),
    "waves": (2, 1.0, True, False),
}


def _forward_transfers(rank: int, world: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(T, H, generator=gen, requires_grad=True)
    w = torch.rand(T, K, generator=gen)
    out: dict[str, Any] = {}
    for name, (chunks, capacity, skewed, given_counts) in CASES.items():
        ids = (torch.tensor([[0, 1]] * T) if skewed  # every row to rank 0: more than its capacity
               else torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)]))
        layer = MoeExperts(local_num_tokens=T, hidden_size=H, intermediate_size=INTER, num_experts=E,
                           top_k=K, ep_size=world, overlap_chunks=chunks, expert_capacity_factor=capacity)
        extra = {"tokens_per_expert": torch.bincount(ids.flatten(), minlength=E)} if given_counts else {}
        layer(x, ids, w, **extra).sum().backward()  # the first call binds (a plan of its own)
        with counting_transfers() as seen:
            layer(x, ids, w, **extra).sum().backward()
        layer.close()
        assert [len(seen["forward"]), len(seen["backward"])] == [1, 1], seen
        forward, backward = seen["forward"][0], seen["backward"][0]
        out[name] = {"reads": forward.reads, "copies_in": forward.copies_in,
                     "backward": backward.reads + [f"copy in {c}" for c in backward.copies_in]}
    return out


def _check(report: dict[str, Any], where: str) -> None:
    for name, transfers in report.items():
        assert len(transfers["reads"]) == 1, f"{where} {name}: {transfers}"
        copies = transfers["copies_in"]
        assert len(copies) <= 1 and all(copies), f"{where} {name}: {transfers}"  # one, non-blocking
        assert transfers["backward"] == [], f"{where} {name}: {transfers}"


def test_two_ranks_one_host_read_per_forward() -> None:
    for rank, report in run_ranks(_forward_transfers, 2, timeout=90).items():
        _check(report, f"rank {rank}")


def test_one_rank_one_host_read_per_forward() -> None:
    assert not dist.is_initialized()
    _check(_forward_transfers(0, 1), "ep_size=1")
