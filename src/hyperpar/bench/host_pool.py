"""``python -m hyperpar.bench.host_pool``: host memory under drifting activation sizes.

Two scenarios, each reporting held bytes, host allocations and process RSS at chosen steps:
1. the pool alone, on the plain and the pinned path (the pinned path's arenas come from
   plain memory here unless an accelerator is present): every step draws a batch size
   and sequence length, offloads a few activations per layer of sizes proportional to the
   tokens, churns some of them mid-step (a slab freed and a new size taken, as when a
   host copy goes stale), and frees them in reverse order with a pending copy event;
2. an ``OffloadSession`` training the package's GPT with random batch sizes and sequence
   lengths at a budget that forces offload (plain path on CPU).
Writes ``hyperpar-bench/host_pool.json``, or ``--out`` (``benchmarks/results/host_pool.json``
updates the committed result).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import resource
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from hyperpar.bench.headlines import write
from hyperpar.bench.result_file import provenance
from hyperpar.offload.runtime import HostPool

MIB = 1 << 20
CHECKPOINTS = (50, 150, 300)
WIDTHS = (128, 512, 128, 256, 1024)  # bytes per token of the activations one layer offloads
LAYERS = 4


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--session-steps", type=int, default=300,
                        help="steps of the OffloadSession scenario (0: skip it)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("hyperpar-bench/host_pool.json"))


def rss_bytes() -> int:
    """Resident set size now (Linux), else the peak so far."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class PendingEvent:
    """A copy event that completes a few pool calls after it was handed back."""

    __slots__ = ("remaining",)

    def __init__(self, calls: int) -> None:
        self.remaining = calls

    def query(self) -> bool:
        return self.remaining <= 0


def step_shape(rng: random.Random) -> tuple[int, int]:
    """(batch size, sequence length) of one step."""
    return rng.randint(1, 8), rng.randint(32, 256)


def run_pool_step(pool: HostPool, shape: tuple[int, int], events: list[PendingEvent]) -> int:
    """One step's acquires and releases (the same for the same shape, as a plan's are);
    returns the step's peak bytes in use."""
    rng = random.Random(hash(shape))
    for e in events:  # a session waits for every copy between steps
        e.remaining = 0
    events.clear()
    pool.new_step()
    tokens = shape[0] * shape[1]
    held: list[torch.Tensor] = []
    peak = 0

    def tick() -> None:
        for e in events:
            e.remaining -= 1
        events[:] = [e for e in events if e.remaining > 0]

    def release(slab: torch.Tensor) -> None:
        event = PendingEvent(rng.randint(0, 6))
        events.append(event)
        pool.release(slab, event)

    for _ in range(LAYERS):
        for width in WIDTHS:
            tick()
            got = pool.acquire_with_event(tokens * width)
            if got is not None:
                got[0].fill_(len(held) & 0xFF)  # what a D2H copy does: touch every byte
                held.append(got[0])
            if held and rng.random() < 0.2:  # a host copy gone stale: freed, a new one taken
                release(held.pop(rng.randrange(len(held))))
            peak = max(peak, pool.in_use_bytes)
    while held:
        tick()
        release(held.pop())
    return peak


def pool_scenario(make_pool: Callable[[], HostPool], steps: int, seed: int,
                  checkpoints: tuple[int, ...] = CHECKPOINTS) -> dict[str, Any]:
    rng = random.Random(seed)
    pool = make_pool()
    events: list[PendingEvent] = []
    max_need = 0
    at: dict[int, dict[str, float]] = {}
    t0 = time.process_time()
    for step in range(1, steps + 1):
        max_need = max(max_need, run_pool_step(pool, step_shape(rng), events))
        if step in checkpoints or step == steps:
            at[step] = {"held_mib": pool.held_bytes / MIB, "allocations": pool.allocations,
                        "rss_mib": rss_bytes() / MIB, "max_step_need_mib": max_need / MIB}
    return {"steps": at, "cpu_s": time.process_time() - t0}


def session_scenario(steps: int, seed: int, checkpoints: tuple[int, ...] = CHECKPOINTS) -> dict[str, Any]:
    from hyperpar.models import GPT, GPTConfig
    from hyperpar.offload import OffloadConfig, OffloadSession

    torch.manual_seed(seed)
    cfg = GPTConfig(vocab_size=512, seq_len=256, n_layer=4, n_head=4, d_model=128)
    model = GPT(cfg)
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    session = OffloadSession(OffloadConfig(max_resident_activation_mb=4, device="cpu"))
    at: dict[int, dict[str, float]] = {}
    warmups = 0
    max_d2h = 0
    t0 = time.process_time()
    for step in range(1, steps + 1):
        batch, seq = rng.randint(1, 4), rng.randint(32, 256)
        idx = torch.randint(0, cfg.vocab_size, (batch, seq + 1), generator=gen)
        warmups += session.phase == "warmup"
        with session:
            model.loss(idx[:, :-1], idx[:, 1:]).backward()
        model.zero_grad(set_to_none=True)
        report = session.last_report
        max_d2h = max(max_d2h, report.bytes_d2h if report is not None else 0)
        if step in checkpoints or step == steps:
            at[step] = {"held_mib": session.held_bytes() / MIB, "allocations": session.host_allocations(),
                        "rss_mib": rss_bytes() / MIB, "max_step_d2h_mib": max_d2h / MIB,
                        "warmups": warmups}
    return {"steps": at, "cpu_s": time.process_time() - t0}


def plain_pool() -> HostPool:
    return HostPool(64 << 30)


def pinned_pool() -> HostPool:
    """The pinned path's carving; real pinned arenas only where an accelerator exists."""
    if torch.accelerator.is_available():
        return HostPool(64 << 30, pin_memory=True)
    return HostPool(64 << 30, pin_memory=True, arena_allocator=lambda n: torch.empty(n, dtype=torch.uint8))


def run(args: argparse.Namespace) -> int:
    torch.set_num_threads(1)
    started = provenance()
    result: dict[str, Any] = {
        "command": "python -m hyperpar.bench.host_pool " + " ".join(
            f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if not k.startswith("_")),
        "machine": platform.machine(), "torch": torch.__version__,
        "load_avg": os.getloadavg(),
        "pool_plain": pool_scenario(plain_pool, args.steps, args.seed),
        "pool_pinned": pool_scenario(pinned_pool, args.steps, args.seed),
    }
    if args.session_steps:
        result["session"] = session_scenario(args.session_steps, args.seed)
    print(json.dumps(write("host_pool", args.out, result, started), indent=1))
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    raise SystemExit(run(parser.parse_args()))
