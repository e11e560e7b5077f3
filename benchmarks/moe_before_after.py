"""MoeExperts fwd+bwd CPU time of two source trees, run alternately (before/after a change).

Each run is a fresh pair of gloo ranks (1 torch thread each) importing ``hyperpar`` from
one ``src`` directory; it times MoeExperts alone (fwd + bwd of ``out.float().square().sum()``,
hidden states and routing weights trainable, gradients set to None first) at the shapes
and dtypes of ``hyperpar bench moe``. A run reports, per cell, the median step CPU time
(``time.process_time``, gloo's threads included) of the slowest rank. Runs of the trees
alternate, so load swings hit both alike; the summary is the median over runs.

    python benchmarks/moe_before_after.py --src before=/work/base/src --src after=src --runs 3
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

SIZES = {
    "fine_grained": dict(tokens=512, hidden=512, inter=256, experts=32, top_k=4),
    "coarse": dict(tokens=512, hidden=512, inter=512, experts=8, top_k=2),
}
DTYPES = ("float32", "bfloat16")


def _rank(rank: int, port: int, steps: int, queue: Any) -> None:
    import torch
    import torch.distributed as dist

    from hyperpar.multicore.moe import MoeExperts

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    out: dict[str, float] = {}
    for shape, size in SIZES.items():
        for dname in DTYPES:
            dtype = getattr(torch, dname)
            torch.manual_seed(0)
            layer = MoeExperts(local_num_tokens=size["tokens"], hidden_size=size["hidden"],
                               intermediate_size=size["inter"], num_experts=size["experts"],
                               top_k=size["top_k"], ep_size=2).to(dtype)
            gen = torch.Generator().manual_seed(rank)
            x = torch.randn(size["tokens"], size["hidden"], generator=gen).to(dtype).requires_grad_()
            probs = torch.softmax(torch.randn(size["tokens"], size["experts"], generator=gen), -1)
            weights, ids = probs.topk(size["top_k"], -1)
            weights = weights.to(dtype).requires_grad_()
            times = []
            for i in range(steps + 2):
                for p in (x, weights, *layer.parameters()):
                    p.grad = None
                dist.barrier()
                start = time.process_time()
                layer(x, ids, weights).float().square().sum().backward()
                if i >= 2:
                    times.append((time.process_time() - start) * 1e3)
            out[f"{shape}/{dname}"] = statistics.median(times)
            out[f"{shape}/{dname}/min"] = min(times)
            layer.close()
    queue.put((rank, out))
    dist.destroy_process_group()


def _child(steps: int) -> None:
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, port, steps, queue)) for r in range(2)]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=900) for _ in procs)
    for p in procs:
        p.join()
    import hyperpar

    cells = {cell: max(results[r][cell] for r in results) for cell in results[0]}
    print(json.dumps({"hyperpar": hyperpar.__file__, "cells": cells}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--src", action="append", default=[], help="NAME=PATH of a src directory")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.child:
        _child(args.steps)
        return
    trees = dict(item.split("=", 1) for item in args.src)
    per_run: dict[str, list[dict[str, float]]] = {name: [] for name in trees}
    loads = []
    for _ in range(args.runs):
        for name, path in trees.items():
            loads.append(os.getloadavg()[0])
            env = dict(os.environ, PYTHONPATH=str(Path(path).resolve()))
            done = subprocess.run([sys.executable, __file__, "--child", "--steps", str(args.steps)],
                                  env=env, capture_output=True, text=True, check=True)
            reply = json.loads(done.stdout.strip().splitlines()[-1])
            per_run[name].append(reply["cells"])
            print(name, reply["hyperpar"], {k: round(v, 1) for k, v in reply["cells"].items()}, flush=True)
    summary = {name: {cell: statistics.median(r[cell] for r in runs) for cell in runs[0]}
               for name, runs in per_run.items()}
    names = list(trees)
    print("cell                    " + "".join(f"{n:>12s}" for n in names)
          + (f"  {names[1]}/{names[0]}" if len(names) == 2 else ""))
    for cell in summary[names[0]]:
        values = [summary[n][cell] for n in names]
        ratio = f"  {values[1] / values[0]:.2f}" if len(values) == 2 else ""
        print(f"{cell:24s}" + "".join(f"{v:12.1f}" for v in values) + ratio)
    print(f"load average (1 min) before each run: {[round(x, 1) for x in loads]}")
    if args.out is not None:
        import torch

        args.out.write_text(json.dumps({
            "command": " ".join(["python", *sys.argv]), "torch": torch.__version__,
            "machine": platform.platform(), "cpus": os.cpu_count(), "load_average_1min": loads,
            "median_cpu_ms_slowest_rank": summary,
            "per_run": per_run}, indent=2) + "\n")


if __name__ == "__main__":
    main()
