"""``hyperpar bench offload``: what replay costs on CPU, side by side with the plain step.

Measurements on the package's GPT, each interleaved with plain steps in one run so the
machine's state affects both alike:
1. budget = the activation peak (nothing needs to move): replay / plain step time, the
   per-op cost of the dispatch path (goal <= 1.10);
2. a do-nothing TorchDispatchMode: the floor any interception pays, for comparison with 1;
   ``replay_over_passthrough_us_per_op`` is what replay adds per op on top of that floor;
3. budget = 50 % of the peak with the thread copy engine: measured replay step time vs the
   simulator's ``predicted_step_ms`` for the schedule (goal: within 25 %).
Writes ``--out`` (default ``./hyperpar-bench/offload.json``) with machine, torch and command.
``--variant plain|replay|passthrough`` times one variant alone (nothing written), for
whole-process timers run side by side from outside.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from hyperpar.bench.headlines import write
from hyperpar.bench.result_file import provenance

MIB = 1 << 20
VARIANTS = ("all", "plain", "replay", "passthrough")


class PassThrough(TorchDispatchMode):
    """The floor: a dispatch mode that only calls the op."""

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        return func(*args, **(kwargs or {}))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="tiny model, few steps (CI smoke test, < 20 s)")
    parser.add_argument("--steps", type=int, default=None,
                        help="timed steps per variant (default 9; quick 3)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads (1: steadier timings on a shared machine)")
    parser.add_argument("--batch", type=int, default=None, help="batch size (default 16; quick 4)")
    parser.add_argument("--variant", choices=VARIANTS, default="all",
                        help="time one variant alone (for whole-process timers); default: all, side by side")
    parser.add_argument("--out", type=Path, default=Path("hyperpar-bench/offload.json"))


def _model(quick: bool, batch: int | None) -> tuple[Callable[[], torch.Tensor], torch.nn.Module,
                                                      dict[str, Any]]:
    from hyperpar.models import GPT, GPTConfig, random_batch

    cfg = GPTConfig.tiny() if quick else GPTConfig.small()
    batch = batch if batch is not None else (4 if quick else 16)
    torch.manual_seed(0)
    model = GPT(cfg)
    x, y = random_batch(cfg, batch, torch.Generator().manual_seed(1))
    return (lambda: model.loss(x, y)), model, {"config": repr(cfg), "batch": batch}


def _step(loss_fn: Callable[[], torch.Tensor], model: torch.nn.Module, session: Any = None) -> float:
    """One fwd+bwd in ms; ``session`` is an OffloadSession, a PassThrough mode, or None."""
    model.zero_grad(set_to_none=True)
    t0 = time.perf_counter()
    if session is None:
        loss_fn().backward()
    else:
        with session:
            loss_fn().backward()
    return (time.perf_counter() - t0) * 1e3


def _interleaved(steps: int, runs: dict[str, Callable[[], float]]) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(steps):
        for name, fn in runs.items():
            times[name].append(fn())
    return times


def measure(quick: bool, steps: int, batch: int | None = None, variant: str = "all") -> dict[str, Any]:
    from hyperpar.offload import OffloadConfig, OffloadSession

    loss_fn, model, model_info = _model(quick, batch)
    for _ in range(2):
        _step(loss_fn, model)  # warm the allocator and the kernels
    probe = OffloadSession(OffloadConfig(max_resident_activation_mb=1 << 20, device="cpu"))
    _step(loss_fn, model, probe)
    assert probe.trace is not None
    peak = max(probe.trace.resident_bytes_without_offload(), default=0)
    at_peak = OffloadConfig(max_resident_activation_mb=peak / MIB, device="cpu")
    at_half = OffloadConfig(max_resident_activation_mb=0.5 * peak / MIB, device="cpu", copy_engine="thread")
    sessions = {"replay_at_peak": OffloadSession(at_peak), "replay_at_50": OffloadSession(at_half)}
    for s in sessions.values():
        _step(loss_fn, model, s)  # warmup: trace and plan
        _step(loss_fn, model, s)  # first replay
    if variant != "all":
        alone = {"plain": None, "replay": sessions["replay_at_peak"], "passthrough": PassThrough()}[variant]
        return {"variant": variant, "step_ms_all": [_step(loss_fn, model, alone) for _ in range(steps)]}
    runs: dict[str, Callable[[], float]] = {"plain": lambda: _step(loss_fn, model),
                                            "passthrough": lambda: _step(loss_fn, model, PassThrough())}
    reports: dict[str, list[Any]] = {name: [] for name in sessions}

    def replay(name: str) -> Callable[[], float]:
        def run() -> float:
            ms = _step(loss_fn, model, sessions[name])
            reports[name].append(sessions[name].last_report)
            return ms
        return run

    for name in sessions:
        runs[name] = replay(name)
    times = _interleaved(steps, runs)
    plain = statistics.median(times["plain"])
    floor = statistics.median(times["passthrough"])
    ops = reports["replay_at_peak"][-1].op_count
    added = (statistics.median(times["replay_at_peak"]) - floor) * 1e3 / max(ops, 1)
    out: dict[str, Any] = {"model": model_info, "activation_peak_bytes": peak, "steps": steps,
                           "op_count": ops, "replay_over_passthrough_us_per_op": added,
                           "plain_step_ms": plain, "plain_step_ms_all": times["plain"],
                           "passthrough": {"step_ms": floor, "ratio_to_plain": floor / plain,
                                           "per_op_overhead_us": (floor - plain) * 1e3 / max(ops, 1)}}
    for name, session in sessions.items():
        last = reports[name][-1]
        med = statistics.median(times[name])
        entry: dict[str, Any] = {
            "budget_bytes": last.budget_bytes, "step_ms": med, "step_ms_all": times[name],
            "ratio_to_plain": med / plain, "op_count": last.op_count,
            "per_op_overhead_us": (med - plain) * 1e3 / max(last.op_count, 1),
            "bytes_d2h": last.bytes_d2h, "bytes_h2d": last.bytes_h2d, "demand_faults": last.demand_faults,
            "exposed_wait_ms": statistics.median(r.exposed_wait_ms for r in reports[name]),
            "peak_resident_bytes": last.peak_resident_bytes, "predicted_step_ms": last.predicted_step_ms,
            "copy_engine": session.copy_engine_name,
        }
        if last.predicted_step_ms:
            entry["prediction_error"] = (med - last.predicted_step_ms) / last.predicted_step_ms
        if session.trace is not None:
            compute = sum(op.duration_ms for op in session.trace.ops)
            entry["trace_compute_ms"] = compute
            entry["bandwidth_gbps"] = [session.trace.d2h_bandwidth_gbps, session.trace.h2d_bandwidth_gbps]
            if last.predicted_step_ms and compute > 0:
                # The same comparison without the warmup's one timing sample: slowdown over the
                # step without offload, predicted (over the trace's compute) vs measured (over plain).
                entry["predicted_slowdown"] = last.predicted_step_ms / compute
                entry["measured_slowdown"] = med / plain
                entry["slowdown_error"] = entry["measured_slowdown"] / entry["predicted_slowdown"] - 1.0
        out[name] = entry
    return out


def _command(args: argparse.Namespace) -> str:
    parts = ["hyperpar", "bench", "offload"]
    if args.quick:
        parts.append("--quick")
    if args.steps is not None:
        parts += ["--steps", str(args.steps)]
    if args.batch is not None:
        parts += ["--batch", str(args.batch)]
    return " ".join([*parts, "--threads", str(args.threads), "--out", str(args.out)])


def run(args: argparse.Namespace) -> int:
    steps = args.steps if args.steps is not None else (3 if args.quick else 9)
    if steps < 1:
        raise SystemExit(f"--steps must be >= 1, got {steps}")
    if args.threads < 1:
        raise SystemExit(f"--threads must be >= 1, got {args.threads}")
    if args.batch is not None and args.batch < 1:
        raise SystemExit(f"--batch must be >= 1, got {args.batch}")
    torch.set_num_threads(args.threads)
    started = provenance(_command(args).split())
    t0 = time.perf_counter()
    result = measure(args.quick, steps, args.batch, args.variant)
    if args.variant != "all":
        times = result["step_ms_all"]
        print(f"{args.variant}: median {statistics.median(times):.2f} ms over {len(times)} steps")
        return 0
    doc = {
        "benchmark": "offload",
        "command": _command(args),
        "torch": torch.__version__,
        "machine": {"platform": platform.platform(), "python": platform.python_version(),
                    "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads()},
        "quick": args.quick,
        **result,
        "wall_s": time.perf_counter() - t0,
    }
    peak, half = result["replay_at_peak"], result["replay_at_50"]
    print(f"GPT {result['model']['config']} batch {result['model']['batch']}, {steps} interleaved steps, "
          f"activation peak {result['activation_peak_bytes'] / MIB:.2f} MiB")
    print(f"{'variant':16s} {'step ms':>9s} {'x plain':>8s} {'us/op':>7s} {'predicted':>10s} {'error':>7s} "
          f"{'x pred':>7s} {'wait ms':>8s} {'MiB d2h':>8s}")
    print(f"{'plain':16s} {result['plain_step_ms']:9.2f} {1.0:8.3f}")
    floor = result["passthrough"]
    print(f"{'passthrough':16s} {floor['step_ms']:9.2f} {floor['ratio_to_plain']:8.3f} "
          f"{floor['per_op_overhead_us']:7.1f}   (a do-nothing dispatch mode: the floor)")
    for name, r in (("replay_at_peak", peak), ("replay_at_50", half)):
        pred = f"{r['predicted_step_ms']:10.2f}" if r.get("predicted_step_ms") else f"{'-':>10s}"
        err = f"{r['prediction_error'] * 100:6.1f}%" if "prediction_error" in r else f"{'-':>7s}"
        slow = f"{r['predicted_slowdown']:7.3f}" if "predicted_slowdown" in r else f"{'-':>7s}"
        print(f"{name:16s} {r['step_ms']:9.2f} {r['ratio_to_plain']:8.3f} {r['per_op_overhead_us']:7.1f} "
              f"{pred} {err} {slow} {r['exposed_wait_ms']:8.2f} {r['bytes_d2h'] / MIB:8.2f}")
    print(f"replay at peak adds {result['replay_over_passthrough_us_per_op']:.2f} us/op over the "
          f"do-nothing dispatch mode ({result['op_count']} ops per step)")
    print("error: measured replay vs the simulator's predicted_step_ms; x pred: the predicted slowdown "
          "over the trace's compute time (compare with x plain)")
    write("offload", args.out, doc, started, indent=2)
    print(f"wrote {args.out}")
    return 0
