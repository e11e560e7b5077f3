"""The layers ``hyperpar bench moe`` puts beside MoeExperts, all computing the same routed SwiGLU experts.

- ``naive_experts``: the expert-parallel layer anyone would write first (one autograd
  all-to-all each way, a Python loop over local experts), but honest about its weights:
  they are split once per call (``unbind(0)``), so its backward does not zero-fill a
  gradient the size of the whole stack for every expert as indexing ``weight[e]`` would.
- ``TorchtitanExperts``: torchtitan's MoE (``GroupedExperts`` behind the all-to-all token
  dispatcher, as its ``RoutedExperts`` composes them) on an EP device mesh, when torchtitan
  is installed (``pip install 'hyperpar[bench]'``). Its ``GroupedExperts`` computes the
  matrix multiplies in bfloat16 whatever the input dtype.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn
import torch.nn.functional as F

TORCHTITAN_NOTE = (
    "torchtitan's GroupedExperts computes its matrix multiplies in bfloat16 whatever the input dtype")


def naive_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
                  down: torch.Tensor, world: int) -> torch.Tensor:
    tokens, top_k = ids.shape
    local = gate_up.shape[0]
    inter = down.shape[1]
    gate_up_e, down_e = gate_up.unbind(0), down.unbind(0)
    flat = ids.flatten()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=local * world)
    recv_counts = torch.empty_like(counts)
    dist.all_to_all_single(recv_counts, counts)
    send_splits = counts.view(world, local).sum(1).tolist()
    per_source = recv_counts.view(world, local)
    recv_splits = per_source.sum(1).tolist()
    sent = x[order // top_k]
    received = dist_fn.all_to_all_single(sent.new_empty(sum(recv_splits), x.shape[1]), sent,
                                         recv_splits, send_splits)
    segments = list(received.split(per_source.flatten().tolist()))
    outputs: list[torch.Tensor | None] = [None] * len(segments)
    for e in range(local):
        rows = torch.cat([segments[s * local + e] for s in range(world)])
        pre = rows @ gate_up_e[e]
        y = (F.silu(pre[:, :inter]) * pre[:, inter:]) @ down_e[e]
        for s, part in enumerate(y.split([segments[s * local + e].shape[0] for s in range(world)])):
            outputs[s * local + e] = part
    back_rows = torch.cat([o for o in outputs if o is not None])
    back = dist_fn.all_to_all_single(back_rows.new_empty(len(order), x.shape[1]), back_rows,
                                     send_splits, recv_splits)
    per_route = torch.empty_like(back).index_copy(0, order, back).view(tokens, top_k, -1)
    return (weights.unsqueeze(-1).to(per_route.dtype) * per_route).sum(1)


def torchtitan_missing() -> str | None:
    """Why torchtitan's MoE cannot run here, or None when it can."""
    try:
        from torchtitan.models.common.moe import GroupedExperts, RoutedExperts  # noqa: F401
        from torchtitan.models.common.token_dispatcher import AllToAllTokenDispatcher  # noqa: F401
    except Exception as exc:  # ImportError, or a dependency failing at import
        return f"{type(exc).__name__}: {exc}"
    return None


class TorchtitanExperts:
    """torchtitan's routed experts with this rank's slice of the same weights."""

    def __init__(self, gate_up: torch.Tensor, down: torch.Tensor, num_experts: int, top_k: int,
                 world: int) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torchtitan.distributed.utils import set_spmd_backend
        from torchtitan.models.common.moe import GroupedExperts, RoutedExperts
        from torchtitan.models.common.token_dispatcher import AllToAllTokenDispatcher

        set_spmd_backend("partial_dtensor")  # plain tensors and functional collectives on the mesh
        local, hidden, two_inter = gate_up.shape
        inter = two_inter // 2
        config = RoutedExperts.Config(
            inner_experts=GroupedExperts.Config(dim=hidden, hidden_dim=inter, num_experts=local),
            token_dispatcher=AllToAllTokenDispatcher.Config(num_experts=num_experts, top_k=top_k))
        self.module: Any = config.build().to(gate_up.dtype)
        self.module.token_dispatcher.wire_meshes(
            ep_mesh=init_device_mesh("cpu", (world,), mesh_dim_names=("ep",)))
        experts = self.module.inner_experts
        with torch.no_grad():
            experts.w1_EFD.copy_(gate_up[:, :, :inter].transpose(1, 2))
            experts.w3_EFD.copy_(gate_up[:, :, inter:].transpose(1, 2))
            experts.w2_EDF.copy_(down.transpose(1, 2))
        self.num_experts = num_experts

    def __call__(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        tokens, top_k = ids.shape
        counts = torch.bincount(ids.flatten(), minlength=self.num_experts)  # as its MoE.forward does
        out = self.module(x.view(1, tokens, -1), weights.view(1, tokens, top_k), ids.view(1, tokens, top_k),
                          counts)
        return out.view(tokens, -1)

    def parameters(self) -> list[torch.nn.Parameter]:
        return list(self.module.parameters())
