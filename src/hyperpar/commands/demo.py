"""hyperpar demo: train a small GPT plainly, with offload and with MoE on spawned ranks.

Prints a progress bar, then tables (loss per step, memory, time), and writes demo.json,
the trace, the schedule and a PNG of resident bytes per op under --out.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from hyperpar.demo.dense import (
    DemoSpec,
    SideBySide,
    loss_differences,
    measure_activation_peak,
    planned_resident_bytes,
    run_differences,
    train_side_by_side,
    weight_differences,
)
from hyperpar.demo.moe_ranks import MoeRunError, MoeSettings, choose_backend, run_moe_ranks
from hyperpar.demo.plot import matplotlib_available, plot_resident_bytes
from hyperpar.demo.results import DemoResult, RunResult
from hyperpar.demo.table import render
from hyperpar.models import GPTConfig
from hyperpar.offload.api.config import resolve_device
from hyperpar.offload.planning.floor import budget_floor

SIZES = {"tiny": GPTConfig.tiny, "small": GPTConfig.small, "medium": GPTConfig.medium}
MIB = 1 << 20

# Exit codes: each names who is to blame, so that a failure never points at the wrong thing.
EXIT_OK = 0
EXIT_OFFLOAD_DIFFERS = 1  # offload changed the numbers: a hyperpar bug
EXIT_USAGE = 2  # bad arguments
EXIT_PLAIN_NOT_REPRODUCIBLE = 3  # plain PyTorch did not repeat itself: offload cannot be judged
EXIT_MOE_FAILED = 4  # the MoE run on spawned ranks failed
EXIT_CODES = f"""exit codes:
  {EXIT_OK}  plain PyTorch repeated itself and offload matched it bit for bit (and MoE ran)
  {EXIT_OFFLOAD_DIFFERS}  offload changed the losses or weights (a bug: please report it with demo.json)
  {EXIT_USAGE}  bad arguments
  {EXIT_PLAIN_NOT_REPRODUCIBLE}  two plain PyTorch runs of the same steps differed: offload not judged
  {EXIT_MOE_FAILED}  the MoE run failed"""


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
    parser.description = textwrap.fill(
        "Train a small GPT (built in, random data) three ways: plain PyTorch (twice, to check that it "
        "repeats itself bit for bit), with offload at a fraction of the measured movable activation peak "
        "plus the bytes the step keeps (losses and weights must be bitwise equal to plain), and with an "
        "MoE feed-forward on spawned ranks. "
        "Writes demo.json, the trace, the schedule and a PNG under --out.", 78)
    parser.epilog = EXIT_CODES
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("--device", default=None,
                        help="cpu, cuda, cuda:1, ... (default: the current accelerator, else cpu)")
    parser.add_argument("--steps", type=_positive_int, default=5, help="training steps per run (default 5)")
    parser.add_argument("--budget-fraction", type=_fraction, default=0.5,
                        help="offload budget: this fraction of the movable activation peak (bytes not "
                             "kept past the step) plus the kept bytes (parameter gradients, the loss), "
                             "as OffloadConfig(max_resident_fraction=F) makes it (default 0.5)")
    parser.add_argument("--out", type=Path, default=Path("hyperpar-demo"),
                        help="folder for demo.json, trace.json, schedule.json and the PNG "
                             "(default ./hyperpar-demo)")
    parser.add_argument("--no-moe", action="store_true", help="skip the MoE run on spawned ranks")
    parser.add_argument("--size", choices=sorted(SIZES), default="small", help="GPT size (default small)")
    parser.add_argument("--batch-size", type=_positive_int, default=8, help="sequences per step (default 8)")
    parser.add_argument("--seed", type=int, default=0, help="seed for weights and batches (default 0)")
    parser.add_argument("--planner", choices=("greedy", "timed"), default="timed",
                        help="offload planner (default timed)")
    parser.add_argument("--threads", type=_positive_int, default=1,
                        help="torch threads for the plain and offload runs (default 1: with more, plain "
                             "PyTorch is not bit-for-bit repeatable on every machine, and on a busy "
                             "machine OpenMP spin-waiting makes steps many times slower; set "
                             "OMP_WAIT_POLICY=PASSIVE if you raise it)")
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


def _load() -> float | None:
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):  # not on every platform
        return None


def run(args: argparse.Namespace) -> int:
    t_start = time.perf_counter()
    device = _device_or_none(args.device)
    if device is None:
        print(f"hyperpar demo: --device must be cpu or an available accelerator, got {args.device!r}",
              file=sys.stderr)
        return EXIT_USAGE
    if args.out.exists() and not args.out.is_dir():
        print(f"hyperpar demo: --out must be a folder, got the file {str(args.out)!r}", file=sys.stderr)
        return EXIT_USAGE
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        return _run(args, device, t_start)
    finally:
        torch.set_num_threads(threads)


def _run(args: argparse.Namespace, device: torch.device, t_start: float) -> int:
    loads = [x for x in [_load()] if x is not None]
    cfg = SIZES[args.size]()
    spec = DemoSpec(cfg=cfg, batch_size=args.batch_size, seed=args.seed, device=device)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    print(f"hyperpar demo: GPT {args.size} ({cfg.n_layer} layers, d_model {cfg.d_model}, seq {cfg.seq_len}), "
          f"batch {args.batch_size}, {args.steps} steps, device {device}, {args.threads} torch thread(s), "
          f"torch {torch.__version__}")

    with _deterministic_kernels(device):
        probe = measure_activation_peak(spec)
        floor = budget_floor(probe.trace)
        budget = probe.budget(args.budget_fraction)
        print(f"measured activation peak {probe.peak_bytes / MIB:.2f} MiB (movable "
              f"{probe.movable_peak_bytes / MIB:.2f} MiB, kept {probe.kept_bytes / MIB:.2f} MiB) -> offload "
              f"budget {budget / MIB:.2f} MiB ({args.budget_fraction:.0%} of the movable activation peak "
              f"+ the kept bytes, planner {args.planner}); feasible floor {floor.floor_bytes / MIB:.2f} MiB "
              f"(no schedule can go lower)")
        bar, on_step = _progress("plain, repeat, offload", args.steps)
        with bar, logging_redirect_tqdm():  # a warning (budget below the floor) gets its own line
            runs = train_side_by_side(spec, args.steps, budget_bytes=budget, planner=args.planner,
                                      on_step=on_step)
    runs.baseline.peak_activation_bytes = probe.peak_bytes
    plain_differences = run_differences(runs, "baseline", "repeat")
    differences = run_differences(runs, "baseline", "offload")
    plain, planned = planned_resident_bytes(runs.session)
    result = DemoResult(
        settings={"size": args.size, "gpt": vars(cfg), "batch_size": args.batch_size, "steps": args.steps,
                  "seed": args.seed, "device": str(device), "budget_fraction": args.budget_fraction,
                  "budget_fraction_of": "movable activation peak, plus the kept bytes",
                  "movable_peak_bytes": probe.movable_peak_bytes, "kept_bytes": probe.kept_bytes,
                  "planner": args.planner, "threads": args.threads, "cpus": os.cpu_count(),
                  "torch": torch.__version__, "moe_ranks": 0 if args.no_moe else args.moe_ranks},
        runs=[runs.baseline, runs.repeat, runs.offload],
        losses_equal=not loss_differences(runs.baseline.losses, runs.offload.losses),
        weights_equal=not weight_differences(runs.models["baseline"], runs.models["offload"]),
        plain_repeats=not plain_differences, plain_differences=plain_differences,
        resident_bytes_plain=plain, resident_bytes_planned=planned, differences=differences)
    _save_offload_files(result, runs, out, budget, args)

    moe_failed = False
    if not args.no_moe:
        moe_failed = not _run_moe(result, spec, args, device)

    result.total_s = time.perf_counter() - t_start
    result.load_average = [*loads, *[x for x in [_load()] if x is not None]]
    (out / "demo.json").write_text(json.dumps(result.as_dict(), indent=2))
    result.files["json"] = str(out / "demo.json")
    print()
    print(render(result))
    print()
    for what, path in sorted(result.files.items()):
        print(f"{what:>9}: {path}")
    return _verdict(result, args.threads, moe_failed)


def _verdict(result: DemoResult, threads: int, moe_failed: bool) -> int:
    """Print who is to blame, if anyone, and return the exit code."""
    total = f"total {result.total_s:.1f} s"
    if not result.plain_repeats:
        print(f"\nplain PyTorch did not repeat itself: offload not judged; {total}")
        hint = ("it ran on 1 thread, where plain PyTorch normally repeats: please report this with demo.json"
                if threads == 1 else f"it ran on {threads} threads; plain PyTorch repeats bit for bit with "
                "--threads 1 (the default)")
        print(f"error: two plain PyTorch runs of the same steps from the same seed differ on this machine, "
              f"so there is no fixed baseline to check offload against ({hint}). Not an offload problem. "
              f"First differences:", file=sys.stderr)
        for line in result.plain_differences[:10]:
            print(f"  {line}", file=sys.stderr)
        return EXIT_PLAIN_NOT_REPRODUCIBLE
    if result.differences:
        print(f"\nlosses and final weights with and without offload: DIFFERENT (plain PyTorch repeated "
              f"itself bit for bit); {total}")
        print("error: offload changed the numbers although plain PyTorch repeats itself here; please report "
              "this with demo.json:", file=sys.stderr)
        for line in result.differences[:20]:
            print(f"  {line}", file=sys.stderr)
        return EXIT_OFFLOAD_DIFFERS
    print(f"\nlosses and final weights with and without offload: bitwise equal (and plain PyTorch repeated "
          f"itself bit for bit); {total}")
    return EXIT_MOE_FAILED if moe_failed else EXIT_OK


def _save_offload_files(result: DemoResult, runs: SideBySide, out: Path, budget: int,
                        args: argparse.Namespace) -> None:
    trace, schedule = runs.session.trace, runs.session.schedule
    if trace is not None and schedule is not None:
        trace.save(out / "trace.json")
        schedule.save(out / "schedule.json")
        result.files["trace"] = str(out / "trace.json")
        result.files["schedule"] = str(out / "schedule.json")
    if not result.resident_bytes_plain:
        return
    if not matplotlib_available():
        runs.offload.notes.append("no PNG: matplotlib is not installed (pip install 'hyperpar[plot]')")
        return
    png = plot_resident_bytes(out / "resident_bytes.png", result.resident_bytes_plain,
                              result.resident_bytes_planned, budget,
                              f"GPT {args.size}: budget {args.budget_fraction:.0%} of the movable activation "
                              f"peak + kept",
                              floor_bytes=runs.offload.min_feasible_budget_bytes)
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
