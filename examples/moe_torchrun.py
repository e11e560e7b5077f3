"""Expert-parallel MoE layers with ``MoeExperts`` under torchrun.

Each rank holds ``num_experts / world_size`` experts; tokens travel to the rank that owns
their expert and back (all-to-all). The layers share one workspace, are checked against
the dense reference (all experts on one rank) at the first step, train a few steps, and
are closed in the same order on every rank.

    torchrun --nproc-per-node 2 examples/moe_torchrun.py               # gloo on CPU
    torchrun --nproc-per-node 2 examples/moe_torchrun.py --size tiny
    torchrun --nproc-per-node 2 examples/moe_torchrun.py --device cuda # NCCL, one GPU per rank
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

from hyperpar.multicore import closing
from hyperpar.multicore.moe import MoeExperts, dense_moe_reference

SIZES = {  # tokens per rank, hidden, intermediate, experts, top-k, layers
    "tiny": (16, 32, 16, 4, 2, 2),
    "small": (1024, 512, 128, 8, 2, 4),
}


def gather_experts(layer: MoeExperts) -> tuple[torch.Tensor, torch.Tensor]:
    """Every expert's weights on every rank (only for the reference check)."""
    out = []
    for weight in (layer.gate_up_weight.detach(), layer.down_weight.detach()):
        parts = [torch.empty_like(weight) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, weight.contiguous())
        out.append(torch.cat(parts))
    return out[0], out[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="small")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--device", default="cpu", help="cpu (gloo) or cuda (NCCL)")
    args = parser.parse_args()
    tokens, hidden, inter, experts, top_k, depth = SIZES[args.size]

    device = torch.device(args.device)
    if device.type == "cuda":
        torch.accelerator.set_device_index(int(os.environ.get("LOCAL_RANK", "0")))
        device = torch.device("cuda", torch.accelerator.current_device_index())
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    torch.manual_seed(0)  # routers are replicated: the same on every rank
    routers = [torch.nn.Linear(hidden, experts, bias=False).to(device) for _ in range(depth)]
    torch.manual_seed(100 + rank)  # each rank's experts are different experts
    layers = [MoeExperts(local_num_tokens=tokens, hidden_size=hidden, intermediate_size=inter,
                         num_experts=experts, top_k=top_k, ep_size=world).to(device) for _ in range(depth)]
    MoeExperts.share_execution_resources(layers)  # one workspace for all layers (they run serially)
    params = [p for m in (*routers, *layers) for p in m.parameters()]
    optimizer = torch.optim.SGD(params, lr=0.1)
    gen = torch.Generator().manual_seed(rank)  # each rank its own tokens

    ok = True
    # closing(): close() in order on every rank when the loop ends; if it raises, a local release
    # that never waits for peers (destroy_process_group releases nothing of ours)
    with closing(layers):
        for step in range(args.steps):
            x = torch.randn(tokens, hidden, generator=gen).to(device)
            for i, (router, layer) in enumerate(zip(routers, layers, strict=True)):
                weights, ids = torch.softmax(router(x), dim=-1).topk(top_k, dim=-1)
                weights = weights / weights.sum(dim=-1, keepdim=True)
                y = layer(x, ids, weights)
                if step == 0 and i == 0:
                    reference = dense_moe_reference(x, ids, weights, *gather_experts(layer))
                    ok = torch.allclose(y, reference, rtol=1e-4, atol=1e-5)
                    print(f"rank {rank}: layer 0 matches the dense reference: {ok} "
                          f"(max diff {(y - reference).abs().max().item():.2e})")
                x = x + y
            loss = x.pow(2).mean()
            loss.backward()  # expert gradients flow back through the all-to-alls
            for router in routers:  # routers are replicated: average their gradients
                for p in router.parameters():
                    dist.all_reduce(p.grad)
                    p.grad /= world
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            print(f"rank {rank}: step {step} loss {loss.item():.6f}, "
                  f"workspace {layers[0].workspace_bytes} bytes")
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
