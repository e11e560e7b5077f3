"""MoeExperts and torchtitan's MoE op by op: where each step's CPU time goes, side by side.

Two gloo ranks, 1 torch thread each, the layers of ``hyperpar bench moe`` on the same weights
and routing. Two measures per variant, both as CPU time (the bench's measure; the profiler's
wall-clock "self CPU" counts waiting and the other rank's load on this shared machine):

- per step, interleaved: process CPU (what the bench reports), the main thread's CPU, and the
  rest (gloo's worker threads moving the all-to-alls);
- per aten op: the main thread's CPU inside every op (a ``TorchDispatchMode`` with
  ``time.thread_time_ns``; MoeExperts' two custom ops are opened up, so their inner ops are
  counted). Ops that are cheap in themselves look dearer here (the mode's own cost per call);
  compare op by op, not the totals.

    PYTHONPATH=src .venv/bin/python benchmarks/moe_profile_vs_torchtitan.py --shape coarse --out x.json
"""

from __future__ import annotations

import argparse
import collections
import os
import platform
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from moe_before_after import run_two_ranks  # this folder is on the path when run as a script
from torch.utils._python_dispatch import TorchDispatchMode

VARIANTS = ("MoeExperts", "torchtitan")


class _OpTimer(TorchDispatchMode):
    """Main-thread CPU per aten op; hyperpar's custom ops run their Python bodies under the mode."""

    def __init__(self) -> None:
        super().__init__()
        from hyperpar.multicore.moe import function

        self.bodies = {"moe_experts": lambda *a: function._forward(function._CALLS[a[-1]], *a[:-1]),
                       "moe_experts_backward": lambda *a: function._backward(function._CALLS[a[-1]], *a[:-1])}
        self.ns: collections.Counter[str] = collections.Counter()
        self.calls: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func.namespace == "hyperpar":
            with self:
                return self.bodies[func._opname](*args, **kwargs)
        start = time.thread_time_ns()
        out = func(*args, **kwargs)
        name = f"{func.namespace}::{func._opname}"
        self.ns[name] += time.thread_time_ns() - start
        self.calls[name] += 1
        return out


def _rank(rank: int, port: int, shape: str, dtype: str, steps: int, queue: Any) -> None:
    warnings.filterwarnings("ignore")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    from hyperpar.bench.moe import SIZES, _Variants

    v = _Variants(SIZES[shape], getattr(torch, dtype), 2, rank)

    def step(name: str) -> None:
        v.clear_grads()
        v.call(name).float().square().sum().backward()

    per_step: dict[str, dict[str, list[float]]] = {n: {"process": [], "thread": []} for n in VARIANTS}
    for i in range(steps + 2):
        for name in VARIANTS[i % 2:] + VARIANTS[:i % 2]:
            dist.barrier()
            process, thread = time.process_time(), time.thread_time()
            step(name)
            if i >= 2:
                per_step[name]["process"].append((time.process_time() - process) * 1e3)
                per_step[name]["thread"].append((time.thread_time() - thread) * 1e3)
    result: dict[str, Any] = {}
    for name in VARIANTS:
        timer = _OpTimer()
        dist.barrier()
        with timer:
            for _ in range(steps):
                step(name)
        process, thread = (statistics.median(per_step[name][k]) for k in ("process", "thread"))
        result[name] = {"process_ms": process, "main_thread_ms": thread, "other_threads_ms": process - thread,
                        "ops_ms": {k: t / steps / 1e6 for k, t in timer.ns.most_common()},
                        "op_calls": {k: c / steps for k, c in timer.calls.items()}}
    v.close()
    queue.put((rank, result))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="coarse", choices=("coarse", "fine_grained"))
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--top", type=int, default=15, help="ops listed per variant")
    parser.add_argument("--out", type=Path, default=None, help="write the JSON here")
    args = parser.parse_args()
    from hyperpar.bench.headlines import write  # a comparison: provenance, no headline
    from hyperpar.bench.result_file import provenance

    started = provenance()
    loads = [os.getloadavg()[0]]
    results = run_two_ranks(_rank, (args.shape, args.dtype, args.steps))
    loads.append(os.getloadavg()[0])
    for name in VARIANTS:
        mine = {r: results[r][name] for r in sorted(results)}
        print(f"{args.shape} {args.dtype} {name}: " + ", ".join(
            f"rank {r} process {m['process_ms']:.1f} ms (main thread {m['main_thread_ms']:.1f}, "
            f"other threads {m['other_threads_ms']:.1f})" for r, m in mine.items()))
        for op, ms in list(mine[0]["ops_ms"].items())[:args.top]:
            print(f"    {op:45s} {ms:7.2f} ms {mine[0]['op_calls'][op]:6.1f} calls  (rank 0, per step)")
    print(f"load average (1 min) before and after: {[round(x, 1) for x in loads]}")
    if args.out is not None:
        write("moe_profile_vs_torchtitan", args.out, {
            "benchmark": "moe_profile_vs_torchtitan", "command": " ".join(["python", *sys.argv]),
            "torch": torch.__version__, "machine": platform.platform(), "cpus": os.cpu_count(),
            "threads_per_rank": 1, "ranks": 2, "steps": args.steps, "load_average_1min": loads,
            "per_rank": results}, started, indent=2)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
