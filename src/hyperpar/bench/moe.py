"""``hyperpar bench moe``: MoeExperts vs an honest naive EP layer and torchtitan's MoE, 2 gloo ranks.

Every variant runs in the same process pair, interleaved step by step (the order rotates
every step), on the same weights and routing, so ratios are fair on a busy machine. Time
is the CPU time of the slowest rank (``time.process_time`` covers gloo's threads too), per
fwd+bwd step with the gradients set to None first as an optimizer would; memory is the
peak rise of the CPU allocator during one step (profiler memory events) plus the buffers
a variant keeps between steps. Each run is a fresh process pair; the summary is the
median over runs with the spread (min, max).
"""

from __future__ import annotations

import argparse
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
import torch.multiprocessing as mp

from hyperpar.bench.headlines import write
from hyperpar.bench.moe_peers import TORCHTITAN_NOTE, TorchtitanExperts, naive_experts, torchtitan_missing
from hyperpar.bench.moe_stack import STACK_DTYPE, measure_stack, summarise_stack
from hyperpar.bench.result_file import provenance
from hyperpar.multicore.moe import MoeExperts, set_grouped_mm_enabled

# Fine-grained experts as in current MoE models (many small experts, larger top-k) and a
# coarse Mixtral-like layer (few big experts).
SIZES = {
    "fine_grained": dict(tokens=512, hidden=512, inter=256, experts=32, top_k=4, steps=6),
    "coarse": dict(tokens=512, hidden=512, inter=512, experts=8, top_k=2, steps=6),
}
QUICK = {"quick": dict(tokens=64, hidden=64, inter=64, experts=4, top_k=2, steps=2)}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
WARMUP_STEPS = 2
GOALS = {"float32": 1.0, "bfloat16": 0.85}  # MoeExperts / torchtitan, issue 13
# The opt-in row of float32 runs: float32 inputs, outputs and gradients, GEMMs in bf16 (as torchtitan's)
BF16_GEMMS = "MoeExperts bf16-GEMM"


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive int, got {value}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="tiny sizes for a CI smoke test")
    parser.add_argument("--steps", type=_positive_int, default=None, help="timed fwd+bwd steps per variant")
    parser.add_argument("--runs", type=_positive_int, default=3, help="fresh process pairs (default 3)")
    parser.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated: float32,bfloat16")
    parser.add_argument("--out", type=Path, default=None,
                        help="write the JSON here (and the plot beside it as .png); "
                             "the committed results are benchmarks/results/moe.json")


class _Variants:
    """The layers of one (shape, dtype) on this rank, on the same weights."""

    def __init__(self, size: dict[str, int], dtype: torch.dtype, world: int, rank: int) -> None:
        tokens, experts, top_k = size["tokens"], size["experts"], size["top_k"]
        torch.manual_seed(0)
        layer_args = dict(local_num_tokens=tokens, hidden_size=size["hidden"],
                          intermediate_size=size["inter"], num_experts=experts, top_k=top_k, ep_size=world)
        self.layer = MoeExperts(**layer_args).to(dtype)
        self.opt_in = None  # strict float32 is the default; the bf16-GEMM opt-in is a row of its own
        if dtype == torch.float32:
            self.opt_in = MoeExperts(**layer_args, gemm_dtype=torch.bfloat16).to(dtype)
            self.opt_in.load_state_dict(self.layer.state_dict())
        self.gate_up = self.layer.gate_up_weight.detach().clone().requires_grad_()
        self.down = self.layer.down_weight.detach().clone().requires_grad_()
        self.peer = None if torchtitan_missing() else TorchtitanExperts(
            self.gate_up.detach(), self.down.detach(), experts, top_k, world)
        gen = torch.Generator().manual_seed(rank)
        # as inside a model: the hidden states and the routing weights come from trainable layers
        self.x = torch.randn(tokens, size["hidden"], generator=gen).to(dtype).requires_grad_()
        probs = torch.softmax(torch.randn(tokens, experts, generator=gen), -1)
        weights, self.ids = probs.topk(top_k, -1)
        self.weights = weights.to(dtype).requires_grad_()
        self.world = world
        self.names = (["MoeExperts", "naive"] + ([BF16_GEMMS] if self.opt_in is not None else [])
                      + (["torchtitan"] if self.peer is not None else []))

    def call(self, name: str) -> torch.Tensor:
        if name == "MoeExperts":
            return self.layer(self.x, self.ids, self.weights)
        if name == BF16_GEMMS:
            assert self.opt_in is not None
            return self.opt_in(self.x, self.ids, self.weights)
        if name == "naive":
            return naive_experts(self.x, self.ids, self.weights, self.gate_up, self.down, self.world)
        assert self.peer is not None
        return self.peer(self.x, self.ids, self.weights)

    def clear_grads(self) -> None:
        params = [self.x, self.weights, self.gate_up, self.down, *self.layer.parameters()]
        params += list(self.opt_in.parameters()) if self.opt_in is not None else []
        for p in params + (self.peer.parameters() if self.peer is not None else []):
            p.grad = None

    def persistent_bytes(self, name: str) -> int:
        if name == BF16_GEMMS and self.opt_in is not None:
            return self.opt_in.workspace_bytes
        return self.layer.workspace_bytes if name == "MoeExperts" else 0

    def close(self) -> None:
        self.layer.close()
        if self.opt_in is not None:
            self.opt_in.close()


def _step_peak_rise(run_step: Any) -> int:
    """Peak bytes the CPU allocator held above the start of one call of ``run_step``."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run_step()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]")
    level = peak = 0
    for _, nbytes in events:
        level += nbytes
        peak = max(peak, level)
    return peak


def _measure(rank: int, world: int, size: dict[str, int], dtype: torch.dtype) -> dict[str, Any]:
    v = _Variants(size, dtype, world, rank)

    def step(name: str) -> None:
        v.clear_grads()
        v.call(name).float().square().sum().backward()

    reference = v.call("MoeExperts").detach().float()
    agree = {n: float((v.call(n).detach().float() - reference).abs().max()) for n in v.names[1:]}
    cpu: dict[str, list[float]] = {n: [] for n in v.names}
    wall: dict[str, list[float]] = {n: [] for n in v.names}
    for i in range(size["steps"] + WARMUP_STEPS):
        turn = i % len(v.names)
        for name in v.names[turn:] + v.names[:turn]:
            dist.barrier()
            c0, w0 = time.process_time(), time.perf_counter()
            step(name)
            if i >= WARMUP_STEPS:
                cpu[name].append((time.process_time() - c0) * 1e3)
                wall[name].append((time.perf_counter() - w0) * 1e3)
    memory = {}
    for name in v.names:
        v.clear_grads()  # outside the window: freeing the last step's gradients is no rise
        dist.barrier()
        rise = _step_peak_rise(lambda n=name: v.call(n).float().square().sum().backward())
        memory[name] = {"rise_bytes": rise, "persistent_bytes": v.persistent_bytes(name)}
    v.clear_grads()
    v.close()
    return {"cpu_ms": cpu, "wall_ms": wall, "memory": memory, "max_abs_diff_vs_moe": agree}


def _workspace_sharing(world: int, size: dict[str, int]) -> dict[str, int]:
    """Workspace bytes of 1, 4 and 8 layers sharing one workspace."""
    out: dict[str, int] = {}
    x = torch.randn(size["tokens"], size["hidden"])
    ids = torch.stack([torch.randperm(size["experts"])[:size["top_k"]] for _ in range(size["tokens"])])
    w = torch.rand(size["tokens"], size["top_k"])
    for count in (1, 4, 8):
        stack = [MoeExperts(local_num_tokens=size["tokens"], hidden_size=size["hidden"],
                            intermediate_size=size["inter"], num_experts=size["experts"], top_k=size["top_k"],
                            ep_size=world) for _ in range(count)]
        if count > 1:
            MoeExperts.share_execution_resources(stack)
        with torch.no_grad():
            for layer in stack:
                layer(x, ids, w)
        out[f"{count}_layers"] = stack[0].workspace_bytes
        for layer in stack:
            layer.close()
    return out


def _grouped_vs_loop(dtype: torch.dtype, size: dict[str, int]) -> dict[str, float]:
    from hyperpar.multicore.moe.grouped_gemm import group_offsets, grouped_mm, grouped_weight_grad

    torch.manual_seed(0)
    experts, hidden, inter = size["experts"], size["hidden"], size["inter"]
    picks = torch.multinomial(torch.ones(experts), size["tokens"] * size["top_k"], replacement=True)
    counts = torch.bincount(picks, minlength=experts).tolist()
    rows = torch.randn(sum(counts), hidden, dtype=dtype)
    weight = torch.randn(experts, hidden, inter, dtype=dtype)
    grad = torch.randn(sum(counts), inter, dtype=dtype)
    offsets = group_offsets(counts, rows.device)
    timings: dict[str, list[float]] = {"grouped": [], "loop": []}
    for _ in range(size["steps"]):
        for name, enabled in (("grouped", True), ("loop", False)):
            set_grouped_mm_enabled(enabled)
            start = time.process_time()
            grouped_mm(rows, weight, counts, offsets)
            grouped_mm(grad, weight.transpose(1, 2), counts, offsets)
            grouped_weight_grad(rows, grad, counts, offsets)
            timings[name].append(time.process_time() - start)
    set_grouped_mm_enabled(True)
    grouped, loop = statistics.median(timings["grouped"]), statistics.median(timings["loop"])
    return {"grouped_ms": grouped * 1e3, "loop_ms": loop * 1e3, "grouped_over_loop": grouped / loop}


def _rank_main(rank: int, world: int, port: int, sizes: dict[str, dict[str, int]], dtypes: list[str],
               queue: Any) -> None:
    warnings.filterwarnings("ignore", category=FutureWarning)  # the baseline's autograd all-to-all
    warnings.filterwarnings("ignore", category=UserWarning)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        result: dict[str, Any] = {
            name: {d: _measure(rank, world, size, DTYPES[d]) for d in dtypes} for name, size in sizes.items()}
        if STACK_DTYPE in dtypes:  # the extra row: serial layers sharing one workspace
            result["stack"] = {name: measure_stack(size, DTYPES[STACK_DTYPE], world, rank, size["steps"],
                                                   _step_peak_rise) for name, size in sizes.items()}
        first = next(iter(sizes.values()))
        result["workspace_bytes_shared"] = _workspace_sharing(world, first)
        if rank == 0:
            result["grouped_mm_vs_loop"] = {d: _grouped_vs_loop(DTYPES[d], first) for d in dtypes}
        queue.put((rank, result))
    except Exception as exc:
        queue.put((rank, f"{type(exc).__name__}: {exc}"))
        raise
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _one_run(world: int, sizes: dict[str, dict[str, int]], dtypes: list[str]) -> dict[int, Any]:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, world, port, sizes, dtypes, queue), daemon=True)
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
        raise RuntimeError(f"moe benchmark rank(s) failed: {failed}")
    return results


def _spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def _summarise(runs: list[dict[int, Any]], shape: str, dtype: str) -> dict[str, Any]:
    """Per run: each variant's median step CPU ms on the slowest rank; then median and spread."""
    per_run = [{n: max(statistics.median(run[r][shape][dtype]["cpu_ms"][n]) for r in run)
                for n in run[0][shape][dtype]["cpu_ms"]} for run in runs]
    names = list(per_run[0])
    summary: dict[str, Any] = {"cpu_ms_slowest_rank": {n: _spread([p[n] for p in per_run]) for n in names}}
    for other in names[1:]:
        summary[f"moe_over_{other}"] = _spread([p["MoeExperts"] / p[other] for p in per_run])
    memory: dict[str, Any] = {}
    for n in names:
        rise = [max(run[r][shape][dtype]["memory"][n]["rise_bytes"] for r in run) for run in runs]
        persistent = max(run[r][shape][dtype]["memory"][n]["persistent_bytes"] for run in runs for r in run)
        memory[n] = {"rise_bytes": int(statistics.median(rise)), "persistent_bytes": persistent,
                     "total_bytes": int(statistics.median(rise)) + persistent}
    summary["memory"] = memory
    summary["max_abs_diff_vs_moe"] = {n: max(run[r][shape][dtype]["max_abs_diff_vs_moe"][n]
                                             for run in runs for r in run) for n in names[1:]}
    if "torchtitan" in names:
        summary["goal_moe_over_torchtitan"] = GOALS.get(dtype)
        if BF16_GEMMS in names:  # the opt-in against the peer that also multiplies in bf16
            summary["bf16_gemm_opt_in_over_torchtitan"] = _spread(
                [p[BF16_GEMMS] / p["torchtitan"] for p in per_run])
    return summary


def _print_table(report: dict[str, Any]) -> None:
    peer = report["torchtitan"]
    print(f"MoE fwd+bwd on 2 gloo ranks: CPU ms of the slowest rank, median of {report['runs']} runs "
          "[min-max]; memory = peak rise in a step + buffers kept between steps")
    if peer["missing"]:
        print(f"  torchtitan's MoE is NOT measured: {peer['missing']} (pip install 'hyperpar[bench]')")
    for shape, by_dtype in report["summary"].items():
        size = report["sizes"][shape]
        print(f"{shape}: T={size['tokens']}/rank H={size['hidden']} I={size['inter']} "
              f"E={size['experts']} K={size['top_k']}")
        for dtype, s in by_dtype.items():
            for name, t in s["cpu_ms_slowest_rank"].items():
                mem = s["memory"][name]
                note = " (bf16 GEMMs)" if name == "torchtitan" and dtype != "bfloat16" else ""
                print(f"  {dtype:8s} {name + note:24s} {t['median']:8.1f} ms [{t['min']:.1f}-{t['max']:.1f}]"
                      f"  memory {mem['total_bytes'] / 2**20:6.1f} MiB (rise {mem['rise_bytes'] / 2**20:.1f}"
                      f" + kept {mem['persistent_bytes'] / 2**20:.1f})")
            ratios = [f"MoeExperts/{k.removeprefix('moe_over_')} = {v['median']:.2f} "
                      f"[{v['min']:.2f}-{v['max']:.2f}]" for k, v in s.items() if k.startswith("moe_over_")]
            goal = s.get("goal_moe_over_torchtitan")
            print("    " + "; ".join(ratios) + (f" (goal vs torchtitan <= {goal})" if goal else ""))
            opt_in = s.get("bf16_gemm_opt_in_over_torchtitan")
            if opt_in is not None:
                print("    opt-in gemm_dtype=torch.bfloat16 (fp32 in/out/grads, bf16 GEMMs as torchtitan's): "
                      f"{BF16_GEMMS}/torchtitan = {opt_in['median']:.2f} "
                      f"[{opt_in['min']:.2f}-{opt_in['max']:.2f}]; the MoeExperts row is strict fp32")
    for shape, row in report.get("stack", {}).items():
        parts = [f"{n} {row['cpu_ms_slowest_rank'][n]:.1f} ms, {m['total_bytes'] / 2**20:.1f} MiB "
                 f"(rise {m['rise_bytes'] / 2**20:.1f} + kept {m['persistent_bytes'] / 2**20:.1f})"
                 for n, m in row["memory"].items()]
        ratio = (f"; MoeExperts/torchtitan = {row['moe_over_torchtitan']:.2f}"
                 if "moe_over_torchtitan" in row else "")
        print(f"{shape}, {row['layers']} serial layers ({row['dtype']}, one shared workspace): "
              + "; ".join(parts) + ratio)
    if not peer["missing"]:
        print(f"  note: {TORCHTITAN_NOTE}")


def _plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(shape, dtype, s) for shape, by in report["summary"].items() for dtype, s in by.items()]
    fig, axes = plt.subplots(2, len(panels), figsize=(3.2 * len(panels), 6), squeeze=False)
    for col, (shape, dtype, s) in enumerate(panels):
        names = list(s["cpu_ms_slowest_rank"])
        t = [s["cpu_ms_slowest_rank"][n] for n in names]
        errors = [[x["median"] - x["min"] for x in t], [x["max"] - x["median"] for x in t]]
        axes[0][col].bar(names, [x["median"] for x in t], yerr=errors, capsize=3, color="C0")
        axes[0][col].set_title(f"{shape}, {dtype}", fontsize=9)
        axes[0][col].set_ylabel("CPU ms / step (slowest rank)" if col == 0 else "")
        rise = [s["memory"][n]["rise_bytes"] / 2**20 for n in names]
        kept = [s["memory"][n]["persistent_bytes"] / 2**20 for n in names]
        axes[1][col].bar(names, rise, color="C1", label="rise in a step")
        axes[1][col].bar(names, kept, bottom=rise, color="C2", label="kept between steps")
        axes[1][col].set_ylabel("MiB" if col == 0 else "")
        for ax in (axes[0][col], axes[1][col]):
            ax.tick_params(axis="x", labelsize=7, rotation=20)
    axes[1][0].legend(fontsize=7)
    fig.suptitle("hyperpar bench moe: 2 gloo ranks (torchtitan: bf16 GEMMs for every dtype)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(args: argparse.Namespace) -> int:
    sizes = {name: dict(size) for name, size in (QUICK if args.quick else SIZES).items()}
    for size in sizes.values():
        if args.steps is not None:
            size["steps"] = args.steps
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    unknown = [d for d in dtypes if d not in DTYPES]
    if unknown or not dtypes:
        print(f"--dtypes: unknown {unknown}, choose from {sorted(DTYPES)}", file=sys.stderr)
        return 2
    world = 2
    started = provenance()
    loads: list[float] = []
    runs: list[dict[int, Any]] = []
    try:
        for _ in range(args.runs):
            loads.append(os.getloadavg()[0])
            runs.append(_one_run(world, sizes, dtypes))
    except RuntimeError as exc:
        print(f"moe benchmark failed: {exc}", file=sys.stderr)
        return 1
    loads.append(os.getloadavg()[0])
    report: dict[str, Any] = {
        "benchmark": "moe",
        "command": " ".join(["hyperpar", *sys.argv[1:]]),
        "machine": {"platform": platform.platform(), "processor": platform.processor(),
                    "cpus": os.cpu_count(), "python": platform.python_version(),
                    "load_average_1min": loads},
        "torch": torch.__version__,
        "ranks": world, "backend": "gloo", "threads_per_rank": 1, "runs": args.runs,
        "measure": "CPU ms (time.process_time) per fwd+bwd step; median over steps on each rank, "
                   "max over ranks, then median/min/max over runs. Memory: peak CPU-allocator rise "
                   "during one step (profiler memory events) + bytes kept between steps.",
        "torchtitan": {"missing": torchtitan_missing(), "note": TORCHTITAN_NOTE},
        "sizes": sizes,
        "summary": {shape: {d: _summarise(runs, shape, d) for d in dtypes} for shape in sizes},
        "stack": ({shape: summarise_stack(runs, shape) for shape in sizes} if "stack" in runs[0][0] else {}),
        "workspace_bytes_shared": runs[0][0]["workspace_bytes_shared"],
        "grouped_mm_vs_loop": runs[0][0]["grouped_mm_vs_loop"],
        "per_run": runs,
    }
    _print_table(report)
    print(f"load average (1 min) before each run and after: {[round(x, 1) for x in loads]}")
    if args.out is None:
        print("(pass --out PATH to write the JSON and the plot)")
        return 0
    write("moe", args.out, report, started, indent=2)
    print(f"wrote {args.out}")
    try:
        _plot(report, args.out.with_suffix(".png"))
        print(f"wrote {args.out.with_suffix('.png')}")
    except ImportError:
        print("matplotlib not installed: no plot (pip install 'hyperpar[plot]')")
    return 0
