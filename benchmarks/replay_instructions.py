"""Replay's cost per op and per step in CPU instructions (deterministic, unlike time here).

Runs ``--steps`` steps of a tiny GPT at batch 1 (``--layers`` blocks) plain, under a
do-nothing TorchDispatchMode (``--variant passthrough``) or replaying an OffloadSession at
budget = peak (``--variant replay``, after its warmup and first replay). Counted under
valgrind, the difference between 12 and 2 steps is the cost of 10 steps, whatever the
import and set-up cost; the difference between depths separates the per-op from the per-step
part. Only the public API is used, so ``PYTHONPATH=<other checkout>/src`` counts another
version. Fix the hash seed: dict layouts otherwise move the count by ~1,500 per op::

    PYTHONHASHSEED=0 valgrind --tool=callgrind --callgrind-out-file=/dev/null .venv/bin/python \\
        benchmarks/replay_instructions.py --variant replay --layers 8 --steps 12 2>&1 | grep refs
"""

from __future__ import annotations

import argparse
from typing import Any

from replay_overhead import tiny_gpt_step  # this folder's: the same model and step

from hyperpar.bench.offload import PassThrough  # the do-nothing dispatch mode
from hyperpar.offload import OffloadConfig, OffloadSession


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variant", choices=("plain", "passthrough", "replay"), required=True)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args()
    run = tiny_gpt_step(args.layers)
    ctx: Any = None
    if args.variant == "passthrough":
        ctx = PassThrough()
    elif args.variant == "replay":
        ctx = OffloadSession(OffloadConfig(max_resident_activation_mb=1 << 20, device="cpu"))
    for _ in range(2 + args.steps):  # two untimed steps: warmup and first replay
        run(ctx)
    if args.variant == "replay":
        report = ctx.last_report
        assert report is not None and report.diverged_at is None, report
        print(f"ops per step {report.op_count}")


if __name__ == "__main__":
    main()
