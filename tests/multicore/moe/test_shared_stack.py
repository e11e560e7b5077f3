"""A stack of 4 layers sharing one workspace trains exactly like 4 independent layers."""

from __future__ import annotations

from typing import Any

import torch

from hyperpar.multicore.moe import MoeExperts
from tests.rank_harness import run_ranks

H, INTER, E, K, T, LAYERS, STEPS = 16, 8, 4, 2, 8, 4, 8


class _Block(torch.nn.Module):
    def __init__(self, world: int) -> None:
        super().__init__()
        self.router = torch.nn.Linear(H, E, bias=False)
        self.experts = MoeExperts(local_num_tokens=T, hidden_size=H, intermediate_size=INTER, num_experts=E,
                                  top_k=K, ep_size=world, overlap_chunks=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.nn.functional.layer_norm(x, (H,))
        weights, ids = torch.softmax(self.router(h), dim=-1).topk(K, dim=-1)
        return x + self.experts(h, ids, weights)


def _train(world: int, shared: bool) -> dict[str, Any]:
    torch.manual_seed(0)  # same weights on every rank and for both stacks
    blocks = torch.nn.ModuleList(_Block(world) for _ in range(LAYERS))
    if shared:
        MoeExperts.share_execution_resources(b.experts for b in blocks)
    optimizer = torch.optim.SGD(blocks.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(7 + torch.distributed.get_rank())
    losses = []
    for _ in range(STEPS):
        x = torch.randn(T, H, generator=gen)
        for block in blocks:
            x = block(x)
        loss = x.square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach())
    result = {"losses": torch.stack(losses), "params": [p.detach().clone() for p in blocks.parameters()],
              "bytes": [b.experts.workspace_bytes for b in blocks],
              "workspaces": len({id(b.experts._resource_group.resources) for b in blocks})}
    for block in blocks:
        block.experts.close()
    return result


def _body(rank: int, world: int) -> dict[str, Any]:
    independent = _train(world, shared=False)
    shared = _train(world, shared=True)
    return {
        "losses_equal": torch.equal(independent["losses"], shared["losses"]),
        "params_equal": all(torch.equal(a, b) for a, b in
                            zip(independent["params"], shared["params"], strict=True)),
        "loss_moved": bool(independent["losses"][-1] != independent["losses"][0]),
        "finite": bool(independent["losses"].isfinite().all()),
        "independent_bytes": independent["bytes"], "shared_bytes": shared["bytes"],
        "independent_workspaces": independent["workspaces"], "shared_workspaces": shared["workspaces"],
    }


def test_shared_stack_equals_independent_layers() -> None:
    for rank, out in run_ranks(_body, 2, timeout=60).items():
        assert out["losses_equal"] and out["params_equal"], f"rank {rank}: {out}"
        assert out["loss_moved"] and out["finite"], f"rank {rank}: training did nothing useful: {out}"
        assert out["independent_workspaces"] == LAYERS and out["shared_workspaces"] == 1
        # send rows + the most rows a call received (at most the lossless 2 * T * K), float32
        largest = max(out["independent_bytes"])
        assert T * K * H * 4 < min(out["independent_bytes"]) and largest <= (T * K + 2 * T * K) * H * 4, out
        assert out["shared_bytes"] == [largest] * LAYERS, out  # one workspace, grown to the largest call
