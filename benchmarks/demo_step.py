"""A compute-bound step: the demo's GPT at 50 % of its activation peak, step time over plain.

Runs ``hyperpar demo --no-moe`` (plain and offload take turns step by step in one process,
CPU) and keeps, per offload step, its wall time over the plain step of the same turn; the
headline is the median over the steps after the first ``--settle`` (warmup and the checked
replays the fast path starts from), and the JSON keeps every step with its replay path.

    .venv/bin/python benchmarks/demo_step.py --out benchmarks/results/demo_step.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from hyperpar.bench import headlines
from hyperpar.bench.result_file import provenance


def measure(steps: int, settle: int, fraction: float, src: str | None = None) -> dict[str, Any]:
    """``src``: the ``src`` folder of another checkout to run the demo from (a before/after)."""
    env = {**os.environ, "PYTHONPATH": src} if src else None
    with tempfile.TemporaryDirectory() as out:
        subprocess.run([sys.executable, "-m", "hyperpar", "demo", "--steps", str(steps), "--no-moe",
                        "--budget-fraction", str(fraction), "--out", out], check=True,
                       stdout=subprocess.DEVNULL, env=env)
        doc = json.loads((Path(out) / "demo.json").read_text())
    runs = doc["runs"]
    plain, offload = runs["baseline"]["step_ms"], runs["offload"]["step_ms"]
    paths = [r.get("replay_path") or r.get("phase") for r in runs["offload"]["reports"]]
    ratios = [o / p for o, p in zip(offload, plain, strict=True)]
    steady = ratios[settle:]
    measured = subprocess.run(["git", "-C", src or ".", "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True).stdout.strip()
    return {"measured_commit": measured, "settings": doc["settings"], "plain_step_ms": plain,
            "offload_step_ms": offload,
            "replay_paths": paths, "over_plain": ratios, "settle": settle,
            "steady_over_plain": {"median": statistics.median(steady), "min": min(steady),
                                  "max": max(steady)},
            "losses_equal": doc["losses_equal"], "weights_equal": doc["weights_equal"]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--settle", type=int, default=4, help="steps left out of the headline (default 4)")
    p.add_argument("--budget-fraction", type=float, default=0.5)
    p.add_argument("--src", help="another checkout's src folder to measure (default: this one)")
    p.add_argument("--out", default="hyperpar-bench/demo_step.json")
    args = p.parse_args(argv)
    started = provenance()
    doc = measure(args.steps, args.settle, args.budget_fraction, args.src)
    s = doc["steady_over_plain"]
    headlines.write("demo_step", args.out, doc, started)
    print(f"{doc['replay_paths']}\nsteady step over plain: {s['median']:.3f} [{s['min']:.3f}-{s['max']:.3f}]"
          f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
