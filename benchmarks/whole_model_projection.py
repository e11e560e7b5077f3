"""Whole HF Llama models projected on h100 and h200: offload, checkpointing and the mixed plan.

Each shape is a whole ``LlamaForCausalLM`` (random bf16 weights from a ``LlamaConfig``, no
download) traced by ``OffloadSession``s on this CPU under ``FastArithmetic`` (the ops, sizes
and dtypes of bf16; matmuls and attention answered by zeros, so a 1B-like model traces in
seconds). Budgets are shares of the movable activation peak (bytes not kept past the step;
parameter gradients and the loss are kept and counted beside it). Per budget, per device,
the projected step (``hyperpar.offload.projection``) of:

- plain PyTorch;
- offload only (the session without recompute, its plan at the budget);
- full checkpointing per layer (``recompute="layers"``, run as plain PyTorch);
- offloaded checkpointing (the checkpointed step's trace, its layer inputs planned to host);
- the mixed plan (``recompute="auto", plan_for=DEVICE``: the session chooses the calls to
  rebuild on that device's model, then plans the rest to host, traced as it really runs).

Host cost per op: equal to plain's (``equal``, isolating the plan) and the CPU-measured
replay cost (``measured``). A budget below a strategy's floor gets its plan for the floor.
Besides the ``--fractions``, each shape is projected at its offload-only floor (``floor``).

    .venv/bin/python benchmarks/whole_model_projection.py --out benchmarks/results/whole_model_projection.json
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from hyperpar.bench import headlines
from hyperpar.bench.result_file import provenance
from hyperpar.offload import OffloadConfig, OffloadSession
from hyperpar.offload.ir import ActivationTrace
from hyperpar.offload.planning.arrays import kept_and_movable_peak, trace_arrays
from hyperpar.offload.planning.floor import budget_floor
from hyperpar.offload.projection import FastArithmetic, HostCosts, get_device
from hyperpar.offload.projection.levers import project_at_budget

log = logging.getLogger("whole_model_projection")
HUGE_MB = float(1 << 30)
FRACTIONS = (0.7, 0.5, 0.3, 0.2, 0.1)
DEVICES = ("h100", "h200")


@dataclass(frozen=True)
class Shape:
    hidden: int
    inter: int
    heads: int
    kv_heads: int
    layers: int
    seq: int
    batch: int
    note: str = ""
    vocab: int = 32000


SHAPES: dict[str, Shape] = {
    "llama_1b_like": Shape(2048, 5632, 16, 16, 16, 1024, 1),
    "llama_8b_like": Shape(4096, 14336, 32, 8, 4, 1024, 1, "4 of 8B's 32 layers"),
    "llama_1b_like_batch8": Shape(2048, 5632, 16, 16, 4, 1024, 8, "device-bound: batch 8, 4 layers"),
    "tiny": Shape(128, 352, 4, 2, 2, 64, 1, "for the documented-commands test", vocab=512),
}
DEFAULT_SHAPES = ("llama_1b_like", "llama_8b_like", "llama_1b_like_batch8")


class Model:
    """One shape's model and batch; ``trace(config, steps)`` runs a fresh session's steps."""

    def __init__(self, shape: Shape) -> None:
        from transformers import LlamaConfig, LlamaForCausalLM

        cfg = LlamaConfig(hidden_size=shape.hidden, intermediate_size=shape.inter,
                          num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
                          num_hidden_layers=shape.layers, vocab_size=shape.vocab,
                          max_position_embeddings=max(shape.seq, 2048), use_cache=False)
        torch.manual_seed(0)
        self.model = LlamaForCausalLM(cfg).to(torch.bfloat16)
        self.ids = torch.randint(0, shape.vocab, (shape.batch, shape.seq))

    def trace(self, config: OffloadConfig, steps: int) -> tuple[ActivationTrace, OffloadSession]:
        session = OffloadSession(config)
        for _ in range(steps):
            self.model.zero_grad(set_to_none=True)
            with FastArithmetic(), session:
                self.model(input_ids=self.ids, labels=self.ids).loss.backward()
        self.model.zero_grad(set_to_none=True)
        trace = session.trace
        assert trace is not None
        return replace(trace, reserve_retained=True), session


def _projected(trace: ActivationTrace, device: str, host: HostCosts, budget: int, movable_peak: int,
               kept: int, plain: bool = False) -> dict[str, Any]:
    """One strategy's projected step and the activation memory it keeps (% of the movable peak)."""
    proj, floor = project_at_budget(trace, get_device(device), host, budget)
    path = proj.plain if plain else proj.replay
    peak = (kept_and_movable_peak(trace_arrays(trace), trace.retained_sids)[1] if plain
            else proj.peak_bytes - kept)  # the plan's peak holds the kept bytes from the start
    return {"step_ms": path.step_us / 1e3, "copy_wait_ms": path.copy_wait_us / 1e3,
            "activation_pct": 100 * max(peak, 0) / movable_peak,
            "floor_pct": 100 * max(floor - kept, 0) / movable_peak,
            "d2h_bytes": proj.bytes_d2h, "below_floor": budget < floor}


def shape_rows(name: str, shape: Shape, fractions: tuple[float, ...], devices: tuple[str, ...],
               bar: tqdm) -> dict[str, Any]:
    started = time.perf_counter()
    model = Model(shape)
    base = OffloadConfig(max_resident_activation_mb=HUGE_MB, device="cpu")
    plain_trace, _ = model.trace(base, 1)
    bar.update()
    kept, movable_peak = kept_and_movable_peak(trace_arrays(plain_trace), plain_trace.retained_sids)
    # the offload-only floor as a share of the movable peak: every strategy projected there too
    floor_fraction = max(budget_floor(plain_trace).floor_bytes - kept, 1) / movable_peak
    ac_trace, ac = model.trace(replace(base, recompute="layers"), 3)
    assert ac.last_report is not None and ac.last_report.bytes_recomputed > 0, "no layer was checkpointed"
    bar.update()
    hosts = {"equal": HostCosts(replay_us=HostCosts().plain_us), "measured": HostCosts()}
    out: dict[str, Any] = {**asdict(shape), "dtype": "bfloat16", "kept_bytes": kept,
                           "movable_peak_bytes": movable_peak, "floor_fraction": floor_fraction,
                           "devices": {}}
    for device in devices:
        dev: dict[str, Any] = {}
        for host_name, host in hosts.items():
            big = plain_trace.peak_bytes_without_offload() * 2
            dev[host_name] = {
                "plain": _projected(plain_trace, device, host, big, movable_peak, kept, plain=True),
                "full_checkpointing": _projected(ac_trace, device, host, big, movable_peak, kept, plain=True),
                "budgets": {},
            }
        for key, frac in [(f"{f:.0%}", f) for f in fractions] + [("floor", floor_fraction)]:
            budget = int(frac * movable_peak) + kept
            mixed_trace, mixed = model.trace(replace(base, recompute="auto", plan_for=device,
                                                     max_resident_fraction=frac), 3)
            bar.update()
            report = mixed.last_report
            assert report is not None and report.budget_bytes == budget, (report, budget)
            for host_name, host in hosts.items():
                dev[host_name]["budgets"][key] = {
                    "budget_bytes": budget,
                    "offload_only": _projected(plain_trace, device, host, budget, movable_peak, kept),
                    "offloaded_checkpointing": _projected(ac_trace, device, host, budget, movable_peak, kept),
                    "mixed": {**_projected(mixed_trace, device, host, budget, movable_peak, kept),
                              "bytes_recomputed": report.bytes_recomputed},
                }
        out["devices"][device] = dev
    out["trace_seconds"] = time.perf_counter() - started
    return out


def plot(doc: dict[str, Any], path: Path) -> None:
    """Projected step / plain against activation memory, one line per strategy, per shape and device."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = [(name, dev) for name, r in doc["shapes"].items() for dev in r["devices"]]
    fig, axes = plt.subplots(1, len(cells), figsize=(4.5 * len(cells), 4), squeeze=False)
    for ax, (name, dev) in zip(axes[0], cells, strict=True):
        r = doc["shapes"][name]["devices"][dev]["equal"]
        plain = r["plain"]["step_ms"]
        for key, style in (("offload_only", "o-"), ("offloaded_checkpointing", "s-"), ("mixed", "^-")):
            pts = sorted((b[key]["activation_pct"], b[key]["step_ms"] / plain) for b in r["budgets"].values())
            ax.plot(*zip(*pts, strict=True), style, label=key.replace("_", " "))
        ac = r["full_checkpointing"]
        ax.plot([ac["activation_pct"]], [ac["step_ms"] / plain], "kx", markersize=9,
                label="full checkpointing")
        ax.plot([100], [1.0], "k.", label="plain")
        ax.set(title=f"{name}, {dev}", xlabel="activation memory, % of the movable peak",
               ylabel="projected step / plain", ylim=(0.9, None))
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", nargs="+", default=list(DEFAULT_SHAPES), choices=list(SHAPES))
    p.add_argument("--fractions", nargs="+", type=float, default=list(FRACTIONS))
    p.add_argument("--devices", nargs="+", default=list(DEVICES), choices=list(DEVICES))
    p.add_argument("--out", default="benchmarks/results/whole_model_projection.json")
    args = p.parse_args(argv)
    for frac in args.fractions:
        if not 0 < frac <= 1:
            p.error(f"--fractions: each must be in (0, 1], got {frac}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s", stream=sys.stderr)
    started = provenance()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    results: dict[str, Any] = {}
    total = len(args.shapes) * (2 + (len(args.fractions) + 1) * len(args.devices))
    with tqdm(total=total, desc="sessions", file=sys.stderr) as bar:
        for name in args.shapes:
            results[name] = shape_rows(name, SHAPES[name], tuple(args.fractions), tuple(args.devices), bar)
    doc = {"benchmark": "whole_model_projection", "fractions": args.fractions, "shapes": results,
           "devices": {d: asdict(get_device(d)) for d in args.devices},
           "host_costs_us": {"equal": asdict(HostCosts(replay_us=HostCosts().plain_us)),
                             "measured": asdict(HostCosts())}}
    out = Path(args.out)
    headlines.write("whole_model_projection", out, doc, started)
    plot(doc, out.with_suffix(".png"))
    for name, r in results.items():
        for dev, rows in r["devices"].items():
            eq = rows["equal"]
            plain = eq["plain"]["step_ms"]
            ac = eq["full_checkpointing"]
            print(f"{name} on {dev}: plain {plain:.2f} ms; full checkpointing {ac['step_ms'] / plain:.2f}x "
                  f"at "
                  f"{ac['activation_pct']:.0f}% (host cost equal to plain's)")
            for frac, b in eq["budgets"].items():
                cells = "  ".join(f"{k} {b[k]['step_ms'] / plain:.2f}x@{b[k]['activation_pct']:.0f}%"
                                  for k in ("offload_only", "offloaded_checkpointing", "mixed"))
                print(f"  {frac}: {cells}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
