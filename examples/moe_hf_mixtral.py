"""Replace the experts of a Hugging Face Mixtral sparse-MoE block by hyperpar's MoeExperts.

Run on CPU with two expert-parallel ranks (gloo)::

    torchrun --nproc-per-node 2 examples/moe_hf_mixtral.py

The block is built from a tiny config with random weights (nothing is downloaded). Every
rank keeps the original block's output as the reference, swaps ``block.experts`` for a
MoeExperts holding only its own experts, checks that the output is the same, and takes a
few training steps through the swapped block.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from transformers import MixtralConfig
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

from hyperpar.multicore import closing
from hyperpar.multicore.moe.hf import replace_hf_moe_experts

TOKENS_PER_RANK = 24


def main() -> float:
    """Returns the largest difference between the original and the swapped block on this rank."""
    own_group = not dist.is_initialized() and int(os.environ.get("WORLD_SIZE", "1")) > 1
    if own_group:
        dist.init_process_group("gloo")
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    try:
        torch.manual_seed(0)  # the same block on every rank
        config = MixtralConfig(hidden_size=32, intermediate_size=16, num_local_experts=4,
                               num_experts_per_tok=2)
        block = MixtralSparseMoeBlock(config)
        for parameter in block.parameters():
            torch.nn.init.normal_(parameter, std=0.2)
        gen = torch.Generator().manual_seed(10 + rank)
        x = torch.randn(2, TOKENS_PER_RANK // 2, config.hidden_size, generator=gen)
        with torch.no_grad():
            expected = block(x)

        experts = replace_hf_moe_experts(block, local_num_tokens=TOKENS_PER_RANK, ep_size=world)
        with torch.no_grad():
            got = block(x)
        difference = float((got - expected).abs().max())
        if not torch.allclose(got, expected, rtol=1e-5, atol=1e-6):
            raise AssertionError(f"rank {rank}: swapped block differs from the original by {difference}")

        optimizer = torch.optim.SGD(block.parameters(), lr=0.05)
        losses = []
        with closing([experts]):  # close() after the loop; on an exception, released here alone
            for _ in range(3):
                loss = block(x).square().mean()
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                losses.append(round(float(loss.detach()), 5))
            del loss  # no graph through the layer may outlive it, or close() refuses
        if rank == 0:
            print(f"ep_size={world}: this rank holds experts {list(experts.local_expert_ids)}; "
                  f"output matches the original block (max diff {difference:.2e}); "
                  f"training losses {losses}")
        return difference
    finally:
        if own_group:
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
