"""``hyperpar bench moe``: MoeExperts vs a naive expert-parallel baseline on 2 gloo ranks.

Both run side by side in one process pair, interleaved step by step, so the ratio is
fair even on a busy machine. Also: overlap_chunks > 1 vs 1, workspace bytes of 1/4/8
shared layers, and torch._grouped_mm vs a loop of mm.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn
import torch.multiprocessing as mp
import torch.nn.functional as F

from hyperpar.multicore.moe import MoeExperts, set_grouped_mm_enabled

# Two realistic small shapes: fine-grained experts as in current MoE models (many small
# experts, larger top-k; the headline) and a coarse Mixtral-like layer (few big experts).
SIZES = {
    "fine_grained": dict(tokens=512, hidden=512, inter=256, experts=32, top_k=4, steps=8),
    "coarse": dict(tokens=512, hidden=512, inter=512, experts=8, top_k=2, steps=8),
}
QUICK = {"quick": dict(tokens=64, hidden=64, inter=64, experts=4, top_k=2, steps=4)}


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive int, got {value}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="tiny sizes for a CI smoke test (< 20 s)")
    parser.add_argument("--steps", type=_positive_int, default=None, help="timed fwd+bwd steps per variant")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/moe.json"))


def naive_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
                  down: torch.Tensor, world: int) -> torch.Tensor:
    """The straightforward expert-parallel layer: fresh buffers, one all-to-all each way with
    autograd, a Python loop over local experts."""
    tokens, top_k = ids.shape
    local = gate_up.shape[0]
    inter = down.shape[1]
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
        pre = rows @ gate_up[e]
        y = (F.silu(pre[:, :inter]) * pre[:, inter:]) @ down[e]
        for s, part in enumerate(y.split([segments[s * local + e].shape[0] for s in range(world)])):
            outputs[s * local + e] = part
    back_rows = torch.cat([o for o in outputs if o is not None])
    back = dist_fn.all_to_all_single(back_rows.new_empty(len(order), x.shape[1]), back_rows,
                                     send_splits, recv_splits)
    per_route = torch.empty_like(back).index_copy(0, order, back).view(tokens, top_k, -1)
    return (weights.unsqueeze(-1) * per_route).sum(1)


def _grouped_vs_loop(dtype: torch.dtype, size: dict[str, int]) -> dict[str, float]:
    from hyperpar.multicore.moe.grouped_gemm import group_offsets, grouped_mm, grouped_weight_grad

    torch.manual_seed(0)
    experts, hidden, inter = size["experts"], size["hidden"], size["inter"]
    counts = torch.multinomial(torch.ones(experts), size["tokens"] * size["top_k"], replacement=True)
    counts = torch.bincount(counts, minlength=experts).tolist()
    rows = torch.randn(sum(counts), hidden, dtype=dtype)
    weight = torch.randn(experts, hidden, inter, dtype=dtype)
    grad = torch.randn(sum(counts), inter, dtype=dtype)
    offsets = group_offsets(counts, rows.device)
    timings: dict[str, list[float]] = {"grouped": [], "loop": []}
    for _ in range(size["steps"]):
        for name, enabled in (("grouped", True), ("loop", False)):
            set_grouped_mm_enabled(enabled)
            start = time.perf_counter()
            grouped_mm(rows, weight, counts, offsets)
            grouped_mm(grad, weight.transpose(1, 2), counts, offsets)
            grouped_weight_grad(rows, grad, counts, offsets)
            timings[name].append(time.perf_counter() - start)
    set_grouped_mm_enabled(True)
    grouped, loop = statistics.median(timings["grouped"]), statistics.median(timings["loop"])
    return {"grouped_ms": grouped * 1e3, "loop_ms": loop * 1e3, "grouped_over_loop": grouped / loop}


def _rank_main(rank: int, world: int, port: int, sizes: dict[str, dict[str, int]], queue: Any) -> None:
    warnings.filterwarnings("ignore", category=FutureWarning)  # the baseline's autograd all-to-all
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        queue.put((rank, {name: _measure(rank, world, size) for name, size in sizes.items()}))
    except Exception as exc:
        queue.put((rank, f"{type(exc).__name__}: {exc}"))
        raise
    finally:
        dist.destroy_process_group()


def _measure(rank: int, world: int, size: dict[str, int]) -> dict[str, Any]:
    tokens, hidden, inter = size["tokens"], size["hidden"], size["inter"]
    experts, top_k = size["experts"], size["top_k"]
    torch.manual_seed(0)
    layers = {chunks: MoeExperts(local_num_tokens=tokens, hidden_size=hidden, intermediate_size=inter,
                                 num_experts=experts, top_k=top_k, ep_size=world, overlap_chunks=chunks)
              for chunks in (1, 2, 4)}
    for layer in layers.values():
        layer.load_state_dict(layers[1].state_dict())
    gate_up = layers[1].gate_up_weight.detach().clone().requires_grad_()
    down = layers[1].down_weight.detach().clone().requires_grad_()
    gen = torch.Generator().manual_seed(rank)
    # as inside a model: the hidden states and the routing weights come from trainable layers
    x = torch.randn(tokens, hidden, generator=gen).requires_grad_()
    logits = torch.randn(tokens, experts, generator=gen).requires_grad_()
    weights, ids = torch.softmax(logits, -1).topk(top_k, -1)
    weights = weights.detach().requires_grad_()

    def variant(name: str) -> torch.Tensor:
        if name == "naive":
            return naive_experts(x, ids, weights, gate_up, down, world)
        return layers[int(name.split("=")[1])](x, ids, weights)

    names = ["naive", "chunks=1", "chunks=2", "chunks=4"]
    reference = variant("naive").detach()
    agree = {n: float((variant(n).detach() - reference).abs().max()) for n in names[1:]}
    x.grad = weights.grad = None
    times: dict[str, list[float]] = {n: [] for n in names}
    for step in range(size["steps"] + 2):
        for name in names:
            dist.barrier()
            start = time.perf_counter()
            variant(name).square().sum().backward()
            elapsed = time.perf_counter() - start
            if step >= 2:  # warm-up
                times[name].append(elapsed)
    median = {n: statistics.median(t) * 1e3 for n, t in times.items()}
    for layer in layers.values():
        layer.zero_grad()
        layer.close()

    workspace: dict[str, int] = {}
    for count in (1, 4, 8):
        stack = [MoeExperts(local_num_tokens=tokens, hidden_size=hidden, intermediate_size=inter,
                            num_experts=experts, top_k=top_k, ep_size=world) for _ in range(count)]
        if count > 1:
            MoeExperts.share_execution_resources(stack)
        with torch.no_grad():
            for layer in stack:
                layer(x, ids, weights)
        workspace[f"{count}_layers"] = stack[0].workspace_bytes
        for layer in stack:
            layer.close()
    result: dict[str, Any] = {"fwd_bwd_ms_median": median, "max_abs_diff_vs_naive": agree,
                              "workspace_bytes_shared": workspace}
    if rank == 0:
        result["grouped_mm_vs_loop"] = {str(dt): _grouped_vs_loop(dt, size)
                                        for dt in (torch.float32, torch.bfloat16)}
    return result


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _summarise(results: dict[int, Any]) -> dict[str, Any]:
    ms = {n: max(results[r]["fwd_bwd_ms_median"][n] for r in results)
          for n in results[0]["fwd_bwd_ms_median"]}
    best_chunks = min((n for n in ms if n.startswith("chunks")), key=ms.__getitem__)
    return {
        "fwd_bwd_ms_median_slowest_rank": ms,
        "moe_over_naive": ms["chunks=1"] / ms["naive"],
        "goal_moe_over_naive": 0.75,
        "chunks2_over_chunks1": ms["chunks=2"] / ms["chunks=1"],
        "chunks4_over_chunks1": ms["chunks=4"] / ms["chunks=1"],
        "best_overlap_chunks": int(best_chunks.split("=")[1]),
        "workspace_bytes_shared": results[0]["workspace_bytes_shared"],
    }


def run(args: argparse.Namespace) -> int:
    sizes = {name: dict(size) for name, size in (QUICK if args.quick else SIZES).items()}
    for size in sizes.values():
        if args.steps is not None:
            size["steps"] = args.steps
    world = 2
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, world, port, sizes, queue), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    try:
        while len(results) < world:
            rank, payload = queue.get(timeout=900)
            results[rank] = payload
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    failed = {r: v for r, v in results.items() if isinstance(v, str)}
    if failed:
        print(f"moe benchmark failed: {failed}", file=sys.stderr)
        return 1
    summaries = {name: _summarise({r: results[r][name] for r in results}) for name in sizes}
    first = next(iter(sizes))
    report = {
        "benchmark": "moe",
        "command": " ".join(["hyperpar", *sys.argv[1:]]),
        "machine": {"platform": platform.platform(), "processor": platform.processor(),
                    "cpus": os.cpu_count(), "python": platform.python_version(),
                    "load_average_1min": os.getloadavg()[0]},
        "torch": torch.__version__,
        "ranks": world, "backend": "gloo", "sizes": sizes,
        "summary": summaries,
        "grouped_mm_vs_loop": results[0][first]["grouped_mm_vs_loop"],
        "per_rank": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    for name, size in sizes.items():
        summary = summaries[name]
        print(f"MoE fwd+bwd, {name}: 2 gloo ranks, T={size['tokens']} H={size['hidden']} I={size['inter']} "
              f"E={size['experts']} K={size['top_k']} (median ms, slowest rank)")
        for variant, value in summary["fwd_bwd_ms_median_slowest_rank"].items():
            print(f"  {variant:9s} {value:8.2f} ms")
        print(f"  MoeExperts/naive = {summary['moe_over_naive']:.2f} (goal <= 0.75); "
              f"chunks=2/chunks=1 = {summary['chunks2_over_chunks1']:.2f}; "
              f"chunks=4/chunks=1 = {summary['chunks4_over_chunks1']:.2f}")
        print(f"  workspace bytes, shared layers: {summary['workspace_bytes_shared']}")
    for dtype, g in report["grouped_mm_vs_loop"].items():
        print(f"grouped_mm/loop of mm, {dtype}: {g['grouped_over_loop']:.2f}")
    print(f"wrote {args.out}")
    return 0
