"""MoeExperts of several source trees side by side in one process pair, steps interleaved.

Each ``--src NAME=PATH`` names a ``src`` directory; its ``hyperpar`` package is copied to a
scratch folder under a distinct name (``hyperpar`` -> ``hyperpar_ab<i>`` in every module,
which also renames its custom-op namespace), so every tree's MoeExperts lives in the same
two gloo ranks (1 torch thread each). Per shape and dtype of ``hyperpar bench moe`` the
layers start from the same weights and routing; their fwd+bwd steps (hidden states and
routing weights trainable, gradients set to None first) alternate in rotating order, so
load swings hit every tree alike. Reported: per tree the median step CPU time
(``time.process_time``, gloo's threads included) of the slowest rank, its ratio to the
first tree, the largest difference of output and gradients from the first tree, and each
tree's memory as ``hyperpar bench moe`` counts it (peak CPU-allocator rise in one step plus
the workspace kept between steps). The ``float32+bf16gemm`` cells are float32 layers with
the ``gemm_dtype=torch.bfloat16`` opt-in.

    .venv/bin/python benchmarks/moe_before_after.py --src main=/path/to/main/src --src new=src
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import shutil
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

SIZES = {
    "fine_grained": dict(tokens=512, hidden=512, inter=256, experts=32, top_k=4),
    "coarse": dict(tokens=512, hidden=512, inter=512, experts=8, top_k=2),
}
DTYPES = ("float32", "bfloat16", "float32+bf16gemm")
WARMUP = 2


def _renamed_copy(src: Path, dest: Path, name: str) -> None:
    shutil.copytree(src / "hyperpar", dest / name)
    for path in (dest / name).rglob("*.py"):
        path.write_text(re.sub(r"\bhyperpar\b", name, path.read_text()))


def _cell(names: list[str], packages: list[str], size: dict[str, int], dtype: Any, rank: int,
          steps: int) -> dict[str, Any]:
    import importlib

    import torch
    import torch.distributed as dist

    dtype, _, gemm = dtype.partition("+")
    dtype = getattr(torch, dtype)
    opt_in = {"gemm_dtype": torch.bfloat16} if gemm == "bf16gemm" else {}
    layers = {}
    for name, package in zip(names, packages, strict=True):
        torch.manual_seed(0)
        cls = importlib.import_module(f"{package}.multicore.moe").MoeExperts
        layers[name] = cls(local_num_tokens=size["tokens"], hidden_size=size["hidden"],
                           intermediate_size=size["inter"], num_experts=size["experts"],
                           top_k=size["top_k"], ep_size=2, **opt_in).to(dtype)
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(size["tokens"], size["hidden"], generator=gen).to(dtype).requires_grad_()
    probs = torch.softmax(torch.randn(size["tokens"], size["experts"], generator=gen), -1)
    weights, ids = probs.topk(size["top_k"], -1)
    weights = weights.to(dtype).requires_grad_()

    def step(name: str) -> list[torch.Tensor]:
        for p in (x, weights, *layers[name].parameters()):
            p.grad = None
        out = layers[name](x, ids, weights)
        out.float().square().sum().backward()
        layer = layers[name]
        return [out.detach(), x.grad, weights.grad, layer.gate_up_weight.grad, layer.down_weight.grad]

    first = step(names[0])
    diffs = {n: max(float((a.float() - b.float()).abs().max()) for a, b in zip(first, step(n), strict=True))
             for n in names[1:]}
    times: dict[str, list[float]] = {n: [] for n in names}
    for i in range(steps + WARMUP):
        turn = i % len(names)
        for name in names[turn:] + names[:turn]:
            dist.barrier()
            start = time.process_time()
            step(name)
            if i >= WARMUP:
                times[name].append((time.process_time() - start) * 1e3)
    memory = {}
    for name in names:
        for t in (x, weights, *layers[name].parameters()):
            t.grad = None  # outside the window: freeing the last step's gradients is no rise
        dist.barrier()
        memory[name] = {"rise_bytes": _peak_rise(lambda n=name: step(n)),
                        "persistent_bytes": layers[name].workspace_bytes}
    for layer in layers.values():
        layer.close()
    return {"cpu_ms": {n: statistics.median(t) for n, t in times.items()}, "max_abs_diff_vs_first": diffs,
            "memory": memory}


def _peak_rise(run: Any) -> int:
    """Peak bytes the CPU allocator held above the start of ``run()`` (as hyperpar bench moe)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run()
    level = peak = 0
    for _, nbytes in sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                            if e.name() == "[memory]"):
        level += nbytes
        peak = max(peak, level)
    return peak


def _rank(rank: int, port: int, root: str, names: list[str], steps: int, cells: list[str] | None,
          queue: Any) -> None:
    import warnings

    import torch
    import torch.distributed as dist

    warnings.filterwarnings("ignore")
    sys.path.insert(0, root)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    packages = [f"hyperpar_ab{i}" for i in range(len(names))]
    result = {f"{shape}/{d}": _cell(names, packages, size, d, rank, steps)
              for shape, size in SIZES.items() for d in DTYPES
              if cells is None or f"{shape}/{d}" in cells}
    queue.put((rank, result))
    dist.destroy_process_group()


def run_two_ranks(target: Any, args: tuple[Any, ...]) -> dict[int, Any]:
    """Run ``target(rank, port, *args, queue)`` in two spawned processes (a gloo pair on a free
    local port); what each put on the queue as ``(rank, result)``, by rank."""
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=target, args=(r, port, *args, queue)) for r in range(2)]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=1800) for _ in procs)
    for p in procs:
        p.join()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--src", action="append", required=True, help="NAME=PATH of a src directory")
    parser.add_argument("--steps", type=int, default=16, help="timed steps per tree and cell")
    parser.add_argument("--out", type=Path, default=None, help="write the JSON here")
    parser.add_argument("--cell", action="append", default=None,
                        choices=[f"{s}/{d}" for s in SIZES for d in DTYPES],
                        help="run only this SHAPE/DTYPE cell (repeatable; default: all six)")
    args = parser.parse_args()
    from hyperpar.bench.headlines import write  # a comparison: provenance, no headline
    from hyperpar.bench.result_file import provenance

    started = provenance()
    trees = dict(item.split("=", 1) for item in args.src)
    names = list(trees)
    import torch

    loads = [os.getloadavg()[0]]
    with tempfile.TemporaryDirectory() as root:
        for i, path in enumerate(trees.values()):
            _renamed_copy(Path(path).resolve(), Path(root), f"hyperpar_ab{i}")
        results = run_two_ranks(_rank, (root, names, args.steps, args.cell))
    loads.append(os.getloadavg()[0])
    summary: dict[str, Any] = {}
    print(f"{'cell':30s}" + "".join(f"{n:>12s}" for n in names) + "   ratios to " + names[0]
          + "   memory rise+kept")
    for cell in results[0]:
        ms = {n: max(results[r][cell]["cpu_ms"][n] for r in results) for n in names}
        diffs = {n: max(results[r][cell]["max_abs_diff_vs_first"][n] for r in results) for n in names[1:]}
        ratios = {n: ms[n] / ms[names[0]] for n in names[1:]}
        memory = {n: {k: max(results[r][cell]["memory"][n][k] for r in results)
                      for k in ("rise_bytes", "persistent_bytes")} for n in names}
        summary[cell] = {"cpu_ms_slowest_rank": ms, "over_first": ratios, "max_abs_diff_vs_first": diffs,
                         "memory_max_over_ranks": memory}
        print(f"{cell:30s}" + "".join(f"{ms[n]:12.1f}" for n in names)
              + "   " + " ".join(f"{n} {r:.3f}" for n, r in ratios.items())
              + "   max diff " + " ".join(f"{d:.1e}" for d in diffs.values())
              + "   MiB " + " / ".join(f"{m['rise_bytes'] / 2**20:.1f}+{m['persistent_bytes'] / 2**20:.1f}"
                                       for m in memory.values()))
    print(f"load average (1 min) before and after: {[round(x, 1) for x in loads]}")
    if args.out is not None:
        write("moe_before_after", args.out, {
            "benchmark": "moe_before_after", "command": " ".join(["python", *sys.argv]),
            "torch": torch.__version__, "machine": platform.platform(), "cpus": os.cpu_count(),
            "threads_per_rank": 1, "ranks": 2, "steps": args.steps, "cells": args.cell,
            "load_average_1min": loads,
            "trees": trees, "summary": summary}, started, indent=2)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
