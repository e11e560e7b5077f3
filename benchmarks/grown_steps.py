"""A step much larger than the only plan of its structure: how close its peak comes to
what it can be, max(budget, floor at its own sizes).

An attention-like step (``softmax(q q^T) q`` layers, batch 2, hidden 64, scores growing
with the square of the length) is planned at length 96, then replayed twice at 256 (2.7x
the tokens, 7x the scores): the first of those follows the length-96 plan at the new
sizes, the second the plan the session made from the first one's measured sizes. For
each budget (a fraction of the peak at 256 without offload) it reports the peaks over
max(budget, floor), the floor over the budget, and what a fresh session's warmup of the
256 step alone reaches. One torch thread. Run it on two source trees to compare them:

    .venv/bin/python benchmarks/grown_steps.py --out benchmarks/results/grown_steps.json
    PYTHONPATH=<other tree>/src .venv/bin/python benchmarks/grown_steps.py
"""

from __future__ import annotations

import argparse
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

import hyperpar
from hyperpar.bench.headlines import write
from hyperpar.bench.result_file import provenance
from hyperpar.offload import OffloadConfig, OffloadSession

MIB = 1 << 20
D = 64


def _weights() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(D, D, generator=g) / 8).requires_grad_() for _ in range(8)]


def _step(session: OffloadSession, length: int, ws: list[torch.Tensor]) -> Any:
    for w in ws:
        w.grad = None
    x = torch.randn(2, length, D, generator=torch.Generator().manual_seed(length))
    with session:
        h = x
        for k in range(0, len(ws), 2):
            q = h @ ws[k]
            h = torch.relu(((q @ q.transpose(1, 2)) / D).softmax(-1) @ q @ ws[k + 1]) + h
        h.square().mean().backward()
    return session.last_report


def _session(budget: int) -> OffloadSession:
    return OffloadSession(OffloadConfig(max_resident_activation_mb=budget / MIB))


def measure(fractions: list[float]) -> list[dict[str, Any]]:
    torch.set_num_threads(1)
    ws = _weights()
    peak = _step(_session(1 << 40), 256, ws).peak_resident_bytes
    rows = []
    for fraction in fractions:
        budget = int(peak * fraction)
        fresh = _step(_session(budget), 256, ws)
        top = max(budget, fresh.min_feasible_budget_bytes)
        session = _session(budget)
        reports = [_step(session, length, ws) for length in (96, 96, 256, 256)]
        rows.append({
            "budget_over_peak": fraction, "floor_over_budget": fresh.min_feasible_budget_bytes / budget,
            "fresh_warmup": fresh.peak_resident_bytes / top,
            "first_at_256": reports[2].peak_resident_bytes / top,
            "second_at_256": reports[3].peak_resident_bytes / top,
            "phases": [r.phase for r in reports],
            "demand_faults_first_at_256": reports[2].demand_faults,
        })
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fractions", default="0.1,0.2,0.3,0.4,0.6")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    started = provenance()
    rows = measure([float(f) for f in args.fractions.split(",")])
    print("peaks over max(budget, floor at 256):")
    print("budget/peak  floor/budget  fresh warmup  first at 256  second at 256")
    for r in rows:
        print(f"{r['budget_over_peak']:11.2f}  {r['floor_over_budget']:12.2f}  {r['fresh_warmup']:12.2f}  "
              f"{r['first_at_256']:12.2f}  {r['second_at_256']:13.2f}")
    if args.out:
        tree = Path(hyperpar.__file__).resolve().parents[2]
        commit = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True).stdout.strip()
        doc = {"benchmark": "grown_steps", "command": " ".join(sys.argv), "tree": commit,
               "torch": torch.__version__, "machine": {"platform": platform.platform(), "python":
                                                        platform.python_version(), "threads": 1},
               "rows": rows}
        write("grown_steps", args.out, doc, started)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
