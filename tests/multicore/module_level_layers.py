"""A torchrun script with MoeExperts layers at module level, as in the README quick start.

    torchrun --standalone --nproc-per-node 2 tests/multicore/module_level_layers.py [close|no-close]

(tests/multicore/test_exit.py starts its two ranks the same way, without torchrun's agent.)

``close`` (default) closes the layers before ``destroy_process_group``; ``no-close`` leaves them
to the exit release. Either way the process must exit 0: a process group still referenced
when the interpreter tears down can abort it ("terminate called without an active exception").
"""

import sys

import torch
import torch.distributed as dist

from hyperpar.multicore import MoeExperts

torch.set_num_threads(1)
dist.init_process_group("gloo")
rank = dist.get_rank()
layers = [MoeExperts(local_num_tokens=8, hidden_size=16, intermediate_size=8, num_experts=4, top_k=2,
                     ep_size=dist.get_world_size()) for _ in range(2)]
MoeExperts.share_execution_resources(layers)
gen = torch.Generator().manual_seed(rank)
x = torch.randn(8, 16, generator=gen)
ids = torch.stack([torch.randperm(4, generator=gen)[:2] for _ in range(8)])
w = torch.rand(8, 2, generator=gen)
for layer in layers:
    x = x + layer(x, ids, w)
x.sum().backward()
if sys.argv[1:] != ["no-close"]:
    for layer in layers:
        layer.close()
dist.destroy_process_group()
print(f"rank {rank} done", flush=True)
