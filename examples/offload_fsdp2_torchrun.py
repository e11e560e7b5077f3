"""Activation offload inside FSDP2 (or DDP) under torchrun.

Every rank builds its OffloadSession before choosing its device: the session binds the
device current at its first step. The GPT's blocks and the root are sharded with
``fully_shard`` (or the model is wrapped in DDP); the session goes around forward and
backward, the optimizer step stays outside. FSDP2's all-gather and reduce-scatter buffers
are pinned by the session (they are FSDP2's to free and re-allocate), every other activation
may go to host. The script measures the activation peak of a steady step, trains at
``--fraction`` of it and without a session, and checks that each rank's losses and shards
are bitwise equal.

    .venv/bin/torchrun --nproc-per-node 2 examples/offload_fsdp2_torchrun.py               # gloo on CPU
    .venv/bin/torchrun --nproc-per-node 2 examples/offload_fsdp2_torchrun.py --wrap ddp --size tiny
    .venv/bin/torchrun --nproc-per-node 2 examples/offload_fsdp2_torchrun.py --device cuda # NCCL
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

from hyperpar.models import GPT, GPTConfig, random_batch
from hyperpar.offload import OffloadConfig, OffloadSession

SIZES = {"tiny": (GPTConfig.tiny(), 4), "small": (GPTConfig.small(), 8)}  # config, batch per rank
MIB = 1 << 20


def wrap(model: nn.Module, how: str) -> nn.Module:
    if how == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model)
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:  # type: ignore[attr-defined]
        fully_shard(block)
    return fully_shard(model)


def train(args: argparse.Namespace, device: torch.device, session: OffloadSession | None,
          steps: int) -> tuple[list[torch.Tensor], nn.Module, list[float]]:
    cfg, batch = SIZES[args.size]
    torch.manual_seed(0)  # the same initial weights on every rank
    model = wrap(GPT(cfg).to(device), args.wrap)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(1000 + dist.get_rank())  # each rank its own data
    losses, cpu_s = [], []
    for _ in range(steps):
        idx, targets = (t.to(device) for t in random_batch(cfg, batch, gen))
        t0 = time.process_time()
        if session is None:
            loss = nn.functional.cross_entropy(model(idx).flatten(0, 1), targets.flatten())
            loss.backward()
        else:
            with session:
                loss = nn.functional.cross_entropy(model(idx).flatten(0, 1), targets.flatten())
                loss.backward()
        cpu_s.append(time.process_time() - t0)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach())
    return losses, model, cpu_s


def local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if hasattr(p, "to_local") else p


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="small")
    parser.add_argument("--wrap", choices=["fsdp", "ddp"], default="fsdp")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--fraction", type=float, default=0.5, help="budget / measured peak (default 0.5)")
    parser.add_argument("--device", default="cpu", help="cpu (gloo) or cuda (NCCL)")
    args = parser.parse_args()
    torch.set_num_threads(1)  # bitwise comparison: one thread is run-to-run deterministic

    # Built before the device is chosen: each session binds the device current at its first step.
    probe = OffloadSession(OffloadConfig(max_resident_activation_mb=1e9))
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.accelerator.set_device_index(int(os.environ.get("LOCAL_RANK", "0")))
        device = torch.device("cuda", torch.accelerator.current_device_index())
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    rank = dist.get_rank()
    try:
        train(args, device, probe, 2)  # FSDP2 initialises in the first step: the second is steady
        peak = probe.last_report.peak_resident_bytes
        session = OffloadSession(OffloadConfig(max_resident_activation_mb=args.fraction * peak / MIB))
        offloaded, off_model, off_s = train(args, device, session, args.steps)
        plain, plain_model, plain_s = train(args, device, None, args.steps)
        same_losses = all(torch.equal(a, b) for a, b in zip(plain, offloaded, strict=True))
        same_shards = all(torch.equal(local(a), local(b)) for a, b in
                          zip(plain_model.parameters(), off_model.parameters(), strict=True))
        report = session.last_report
        steady = slice(2, None) if args.steps > 2 else slice(None)
        off_ms = 1e3 * sum(off_s[steady]) / len(off_s[steady])
        plain_ms = 1e3 * sum(plain_s[steady]) / len(plain_s[steady])
        print(f"rank {rank}: {args.wrap} on {session.device}, "
              f"peak {report.peak_resident_bytes / MIB:.2f} MiB / budget {report.budget_bytes / MIB:.2f} MiB "
              f"(plain peak {peak / MIB:.2f} MiB), "
              f"d2h {report.bytes_d2h / MIB:.2f} MiB, "
              f"step CPU ms in session {off_ms:.1f} / plain {plain_ms:.1f}, "
              f"losses bitwise equal: {same_losses}, shards bitwise equal: {same_shards}", flush=True)
        return 0 if same_losses and same_shards else 1
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
