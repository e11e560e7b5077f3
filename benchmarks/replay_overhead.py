"""What replay adds per op over a do-nothing TorchDispatchMode, in CPU time.

Uses only the public API (``OffloadSession``, ``OffloadConfig``, ``hyperpar.models.GPT``), so
the same file measures any version of hyperpar: run it with ``PYTHONPATH=<other>/src`` for a
"before" figure. A tiny GPT at batch 1, so per-op costs dominate the step; plain, the
do-nothing mode and replay at budget = peak (nothing moves) take turns step by step; each
step is timed with ``time.process_time`` (CPU seconds of this process: less sensitive to
other jobs than wall time). Run at two depths, the difference in (replay - passthrough)
over the difference in ops is the cost per op; what is left is a cost per step (entering
and leaving the session), which a small step would otherwise spread over its few ops.

    .venv/bin/python benchmarks/replay_overhead.py --steps 200 --out hyperpar-bench/replay_overhead.json
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import hyperpar
from hyperpar.bench.headlines import write
from hyperpar.bench.offload import PassThrough  # the do-nothing dispatch mode
from hyperpar.bench.result_file import provenance
from hyperpar.models import GPT, GPTConfig, random_batch
from hyperpar.offload import OffloadConfig, OffloadSession


def tiny_gpt_step(n_layer: int) -> Callable[[Any], None]:
    """One fwd+bwd of a tiny GPT at batch 1 inside ``ctx`` (None: plain), on one thread."""
    torch.set_num_threads(1)
    cfg = dataclasses.replace(GPTConfig.tiny(), n_layer=n_layer)
    torch.manual_seed(0)
    model = GPT(cfg)
    x, y = random_batch(cfg, 1, torch.Generator().manual_seed(1))

    def run(ctx: Any) -> None:
        model.zero_grad(set_to_none=True)
        with ctx if ctx is not None else contextlib.nullcontext():
            model.loss(x, y).backward()

    return run


def measure(steps: int, n_layer: int) -> dict[str, Any]:
    run = tiny_gpt_step(n_layer)

    def step(ctx: Any) -> float:
        t0 = time.process_time()
        run(ctx)
        return (time.process_time() - t0) * 1e3

    probe = OffloadSession(OffloadConfig(max_resident_activation_mb=1 << 20, device="cpu"))
    step(probe)
    assert probe.trace is not None
    peak = max(probe.trace.resident_bytes_without_offload(), default=0)
    session = OffloadSession(OffloadConfig(max_resident_activation_mb=peak / (1 << 20), device="cpu"))
    for _ in range(3):
        step(session)  # warmup, then replays
    runs: dict[str, Callable[[], float]] = {
        "plain": lambda: step(None), "passthrough": lambda: step(PassThrough()),
        "replay": lambda: step(session)}
    times: dict[str, list[float]] = {k: [] for k in runs}
    for i in range(steps):
        order = list(runs) if i % 2 == 0 else list(reversed(runs))
        for name in order:
            times[name].append(runs[name]())
    report = session.last_report
    assert report is not None and report.diverged_at is None and report.bytes_d2h == 0
    ops = report.op_count
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"ops": ops, "steps": steps, "cpu_ms_median": med,
            "passthrough_over_plain_us_per_op": (med["passthrough"] - med["plain"]) * 1e3 / ops,
            "replay_over_passthrough_us_per_op": (med["replay"] - med["passthrough"]) * 1e3 / ops,
            "replay_over_plain": med["replay"] / med["plain"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--label", default="")
    parser.add_argument("--out", type=Path, default=Path("hyperpar-bench/replay_overhead.json"))
    args = parser.parse_args()
    started = provenance()
    shallow, deep = (measure(args.steps, n) for n in (2, 8))
    extra_ops = deep["ops"] - shallow["ops"]
    added = {k: d["replay_over_passthrough_us_per_op"] * d["ops"] for k, d in (("2", shallow), ("8", deep))}
    per_op = (added["8"] - added["2"]) / extra_ops
    result: dict[str, Any] = {
        "n_layer_2": shallow, "n_layer_8": deep,
        "replay_over_passthrough_us_per_op": per_op,
        "replay_over_passthrough_us_per_step": added["2"] - per_op * shallow["ops"]}
    result.update(label=args.label, hyperpar=str(Path(hyperpar.__file__).parent), torch=torch.__version__,
                  load_average=list(os.getloadavg()))
    write("replay_overhead", args.out, result, started, indent=2)
    print(f"{args.label or 'this'}: replay adds {per_op:.2f} us per op and "
          f"{result['replay_over_passthrough_us_per_step']:.0f} us per step over a do-nothing dispatch mode "
          f"({shallow['ops']} and {deep['ops']} ops; whole-step averages "
          f"{shallow['replay_over_passthrough_us_per_op']:.2f} and "
          f"{deep['replay_over_passthrough_us_per_op']:.2f} us/op)")


if __name__ == "__main__":
    main()
