"""Cost of interception: replay step time vs the same step without offload, side by side.

Plain and replay steps alternate in one process (so drift hits both alike); the result
is the ratio of medians, and the extra microseconds per dispatched op. At the default
budget (= the measured activation peak) nothing needs moving, so this isolates the
dispatch-mode and replay bookkeeping cost.

    python benchmarks/offload_overhead.py [--model small] [--steps 20] [--fraction 1.0]
    python benchmarks/offload_overhead.py --variant replay   # one variant only, for outside timers

A do-nothing dispatch mode is timed alongside as the floor any interception pays.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from hyperpar.models.gpt import GPT, GPTConfig, random_batch
from hyperpar.offload import OffloadConfig, OffloadSession

MIB = 1 << 20


class PassThrough(TorchDispatchMode):
    """The floor: a dispatch mode that does nothing but call the op."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        return func(*args, **(kwargs or {}))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["tiny", "small", "medium"], default="small")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--fraction", type=float, default=1.0, help="budget as a fraction of the peak")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--variant", choices=["both", "plain", "replay", "passthrough"], default="both")
    parser.add_argument("--json", type=Path, default=None, help="write the figures here")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    cfg = getattr(GPTConfig, args.model)()
    model = GPT(cfg)
    idx, tgt = random_batch(cfg, args.batch, torch.Generator().manual_seed(0))

    def step(session: OffloadSession | None, bare: bool = False) -> float:
        t0 = time.perf_counter()
        if bare:
            with PassThrough():
                model.loss(idx, tgt).backward()
        elif session is None:
            model.loss(idx, tgt).backward()
        else:
            with session:
                model.loss(idx, tgt).backward()
        elapsed = time.perf_counter() - t0
        model.zero_grad(set_to_none=True)
        return elapsed

    probe = OffloadSession(OffloadConfig(max_resident_activation_mb=1e9))
    step(probe)
    peak = probe.last_report.peak_resident_bytes
    session = OffloadSession(OffloadConfig(max_resident_activation_mb=peak * args.fraction / MIB))
    step(session)  # warmup (trace + plan)
    step(session)
    step(None)
    plain: list[float] = []
    replay: list[float] = []
    bare: list[float] = []
    for _ in range(args.steps):
        if args.variant in ("both", "plain"):
            plain.append(step(None))
        if args.variant in ("both", "passthrough"):
            bare.append(step(None, bare=True))
        if args.variant in ("both", "replay"):
            replay.append(step(session))
    ops = session.last_report.op_count
    if args.variant != "both":
        times = plain or replay or bare
        print(f"{args.variant}: median {statistics.median(times) * 1e3:.2f} ms over {len(times)} steps")
        return 0
    p, r, b = statistics.median(plain), statistics.median(replay), statistics.median(bare)
    result = {
        "model": args.model, "batch": args.batch, "threads": args.threads, "steps": args.steps,
        "budget_fraction": args.fraction, "activation_peak_bytes": peak, "ops_per_step": ops,
        "plain_median_ms": p * 1e3, "replay_median_ms": r * 1e3, "replay_over_plain": r / p,
        "overhead_us_per_op": (r - p) / ops * 1e6, "passthrough_median_ms": b * 1e3,
        "passthrough_over_plain": b / p, "passthrough_us_per_op": (b - p) / ops * 1e6,
        "last_report": session.last_report.as_dict(),
        "machine": platform.platform(), "python": platform.python_version(), "torch": torch.__version__,
        "command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
    }
    print(f"GPT {args.model} batch {args.batch}, {ops} ops/step, budget {args.fraction:.0%} of "
          f"{peak / MIB:.1f} MiB peak, {args.steps} alternating steps")
    print(f"plain median {p * 1e3:.2f} ms | replay median {r * 1e3:.2f} ms | "
          f"replay/plain {r / p:.3f} | {result['overhead_us_per_op']:.1f} us/op")
    print(f"floor: a do-nothing dispatch mode, median {b * 1e3:.2f} ms | passthrough/plain {b / p:.3f} | "
          f"{result['passthrough_us_per_op']:.1f} us/op")
    print(f"last replay: {session.last_report}")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
