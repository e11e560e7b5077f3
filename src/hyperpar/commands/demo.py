"""``hyperpar demo``: train a small GPT without offload, with offload, and with MoE on 2 ranks.

Prints a progress bar per run, then a table (loss per step, peak activation bytes, bytes
moved, step time, predicted vs measured), and writes ``demo.json``, the trace, the
schedule and a PNG of resident bytes per op under ``--out``. Exit code 1 when the
offload run's losses or final weights differ from the baseline's (they must be bitwise
equal), or when the MoE run fails.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from tqdm import tqdm

from hyperpar.demo.dense import (
    DemoSpec,
    loss_differences,
    measure_activation_peak,
    planned_resident_bytes,
    train_dense,
    weight_differences,
)
from hyperpar.demo.moe_ranks import MoeRunError, MoeSettings, choose_backend, run_moe_ranks
from hyperpar.demo.plot import matplotlib_available, plot_resident_bytes
from hyperpar.demo.results import DemoResult, RunResult
from hyperpar.demo.table import render
from hyperpar.models import GPTConfig
from hyperpar.offload.api.config import resolve_device

SIZES = {"tiny": GPTConfig.tiny, "small": GPTConfig.small, "medium": GPTConfig.medium}
MIB = 1 << 20


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _fraction(text: str) -> float:
    value = float(text)
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {value}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default=None,
                        help="cpu, cuda, cuda:1, ... (default: the current accelerator, else cpu)")
    parser.add_argument("--steps", type=_positive_int, default=5, help="training steps per run (default 5)")
    parser.add_argument("--budget-fraction", type=_fraction, default=0.5,
                        help="offload budget as a fraction of the measured activation peak (default 0.5)")
    parser.add_argument("--out", type=Path, default=Path("hyperpar-demo"),
                        help="folder for demo.json, trace.json, schedule.json and the PNG "
                             "(default ./hyperpar-demo)")
    parser.add_argument("--no-moe", action="store_true", help="skip the MoE run on spawned ranks")
    parser.add_argument("--size", choices=sorted(SIZES), default="small", help="GPT size (default small)")
    parser.add_argument("--batch-size", type=_positive_int, default=8, help="sequences per step (default 8)")
    parser.add_argument("--seed", type=int, default=0, help="seed for weights and batches (default 0)")
    parser.add_argument("--planner", choices=("greedy", "timed"), default="timed",
                        help="offload planner (default greedy)")
    parser.add_argument("--moe-ranks", type=_positive_int, default=2,
                        help="ranks for the MoE run (default 2)")
    parser.add_argument("--timeout", type=_positive_float, default=120.0,
                        help="seconds before a stuck MoE run is killed (default 120)")


def _progress(name: str, steps: int) -> tuple[tqdm, object]:
    bar = tqdm(total=steps, desc=f"{name:>9}", unit="step", file=sys.stderr, dynamic_ncols=True)

    def on_step(step: int, loss: float) -> None:
        bar.set_postfix(loss=f"{loss:.4f}")
        bar.update(1)

    return bar, on_step


@contextlib.contextmanager
def _deterministic_kernels(device: torch.device) -> Iterator[None]:
    """Bitwise equality on a GPU needs deterministic kernels: cuBLAS with a fixed workspace,
    deterministic embedding backward, and the math attention (fused attention backward
    accumulates with atomics). On CPU the kernels already are; nothing changes there."""
    if device.type != "cuda":
        yield
        return
    from torch.nn.attention import SDPBackend, sdpa_kernel

    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        with sdpa_kernel(SDPBackend.MATH):
            yield
    finally:
        torch.use_deterministic_algorithms(before)


def _device_or_none(text: str | None) -> torch.device | None:
    try:
        device = resolve_device(text)
    except RuntimeError:
        return None
    if device.type == "cpu":
        return device
    acc = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    return device if acc is not None and acc.type == device.type else None


def run(args: argparse.Namespace) -> int:
    t_start = time.perf_counter()
    device = _device_or_none(args.device)
    if device is None:
        print(f"hyperpar demo: --device must be cpu or an available accelerator, got {args.device!r}",
              file=sys.stderr)
        return 2
    if args.out.exists() and not args.out.is_dir():
        print(f"hyperpar demo: --out must be a folder, got the file {str(args.out)!r}", file=sys.stderr)
        return 2
    cfg = SIZES[args.size]()
    spec = DemoSpec(cfg=cfg, batch_size=args.batch_size, seed=args.seed, device=device)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    print(f"hyperpar demo: GPT {args.size} ({cfg.n_layer} layers, d_model {cfg.d_model}, seq {cfg.seq_len}), "
          f"batch {args.batch_size}, {args.steps} steps, device {device}, torch {torch.__version__}")

    with _deterministic_kernels(device):
        peak, _ = measure_activation_peak(spec)
        budget = max(1, int(peak * args.budget_fraction))
        print(f"measured activation peak {peak / MIB:.2f} MiB -> offload budget {budget / MIB:.2f} MiB "
              f"({args.budget_fraction:.0%}, planner {args.planner})")
        bar, on_step = _progress("baseline", args.steps)
        with bar:
            baseline, base_model, _ = train_dense(spec, args.steps, on_step=on_step)
        baseline.peak_activation_bytes = peak
        bar, on_step = _progress("offload", args.steps)
        with bar:
            offload, off_model, session = train_dense(spec, args.steps, budget_bytes=budget,
                                                      planner=args.planner, on_step=on_step)
    assert session is not None
    differences = loss_differences(baseline.losses, offload.losses)
    losses_equal = not differences
    weights_differ = weight_differences(base_model, off_model)
    same_weights = not weights_differ
    differences += weights_differ
    plain, planned = planned_resident_bytes(session)
    result = DemoResult(
        settings={"size": args.size, "gpt": vars(cfg), "batch_size": args.batch_size, "steps": args.steps,
                  "seed": args.seed, "device": str(device), "budget_fraction": args.budget_fraction,
                  "planner": args.planner, "torch": torch.__version__, "moe_ranks": 0 if args.no_moe
                  else args.moe_ranks},
        runs=[baseline, offload], losses_equal=losses_equal, weights_equal=same_weights,
        resident_bytes_plain=plain, resident_bytes_planned=planned, differences=differences)
    _save_offload_files(result, session, out, budget, args)

    moe_failed = False
    if not args.no_moe:
        moe_failed = not _run_moe(result, spec, args, device)

    result.total_s = time.perf_counter() - t_start
    (out / "demo.json").write_text(json.dumps(result.as_dict(), indent=2))
    result.files["json"] = str(out / "demo.json")
    print()
    print(render(result))
    print()
    for what, path in sorted(result.files.items()):
        print(f"{what:>9}: {path}")
    verdict = "bitwise equal" if losses_equal and same_weights else "DIFFERENT"
    print(f"\nlosses and final weights with and without offload: {verdict}; "
          f"total {result.total_s:.1f} s")
    if not (losses_equal and same_weights):
        print("error: offload changed the numbers; please report this with demo.json:", file=sys.stderr)
        for line in differences[:20]:
            print(f"  {line}", file=sys.stderr)
        return 1
    return 1 if moe_failed else 0


def _save_offload_files(result: DemoResult, session: object, out: Path, budget: int,
                        args: argparse.Namespace) -> None:
    trace, schedule = getattr(session, "trace", None), getattr(session, "schedule", None)
    if trace is not None and schedule is not None:
        trace.save(out / "trace.json")
        schedule.save(out / "schedule.json")
        result.files["trace"] = str(out / "trace.json")
        result.files["schedule"] = str(out / "schedule.json")
    if not result.resident_bytes_plain:
        return
    if not matplotlib_available():
        result.runs[1].notes.append("no PNG: matplotlib is not installed (pip install 'hyperpar[plot]')")
        return
    png = plot_resident_bytes(out / "resident_bytes.png", result.resident_bytes_plain,
                              result.resident_bytes_planned, budget,
                              f"GPT {args.size}: budget {args.budget_fraction:.0%} of the activation peak")
    result.files["png"] = str(png)


def _run_moe(result: DemoResult, spec: DemoSpec, args: argparse.Namespace, device: torch.device) -> bool:
    backend, note = choose_backend(device, args.moe_ranks)
    threads = max(1, (os.cpu_count() or 1) // args.moe_ranks)
    experts = args.moe_ranks * max(2, -(-4 // args.moe_ranks))  # at least 4, a multiple of the ranks
    settings = MoeSettings(cfg=spec.cfg, batch_size=spec.batch_size, seed=spec.seed, steps=args.steps,
                           num_experts=experts, backend=backend, threads_per_rank=threads)
    bar, on_step = _progress(f"moe x{args.moe_ranks}", args.steps)
    try:
        with bar:
            moe = run_moe_ranks(settings, world_size=args.moe_ranks, timeout_s=args.timeout, on_step=on_step)
    except (MoeRunError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        failed = RunResult(name=f"moe x{args.moe_ranks}", losses=[], step_ms=[], notes=[f"FAILED: {exc}"])
        result.runs.append(failed)
        return False
    if note:
        moe.notes.append(note)
    result.runs.append(moe)
    return True
