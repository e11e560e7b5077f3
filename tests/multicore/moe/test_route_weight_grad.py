"""The routing weights' gradient is taken on the expert side and sent back, so whether it
travels is agreed by every EP rank: it is the same whatever else is trainable, also when only
one rank's routing weights want it, and nobody waits for an exchange another skipped."""

from __future__ import annotations

from typing import Any

import torch

from hyperpar.multicore.moe import MoeExperts
from tests.rank_harness import run_ranks


def _route_weight_grads(rank: int, world: int) -> dict[str, Any]:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    layer = MoeExperts(local_num_tokens=24, hidden_size=16, intermediate_size=8, num_experts=4, top_k=2,
                       ep_size=world).double()
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(20 + rank, 16, generator=gen, dtype=torch.float64)
    weights, ids = torch.softmax(torch.randn(20 + rank, 4, generator=gen), -1).double().topk(2, -1)

    def route_grad(hidden: bool, experts: bool, mine: bool) -> torch.Tensor | None:
        layer.requires_grad_(experts)
        w = weights.clone().requires_grad_(mine)
        out = layer(x.clone().requires_grad_(hidden), ids, w)
        if out.requires_grad:
            out.square().sum().backward()
        return w.grad

    everything = route_grad(True, True, True)
    out = {"only_weights": route_grad(False, False, True), "only_rank_0": route_grad(False, True, rank == 0),
           "with_experts": route_grad(False, True, True)}
    layer.close()
    return {"everything": everything, **out}


def test_route_weight_grad_does_not_depend_on_what_else_trains() -> None:
    for rank, out in run_ranks(_route_weight_grads, 2, timeout=90).items():
        everything = out["everything"]
        assert everything is not None and bool(everything.abs().sum() > 0), rank
        assert torch.equal(out["only_weights"], everything), rank
        assert torch.equal(out["with_experts"], everything), rank
        if rank == 0:
            assert torch.equal(out["only_rank_0"], everything)
        else:
            assert out["only_rank_0"] is None
