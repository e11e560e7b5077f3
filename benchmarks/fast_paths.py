"""Which path each step of a session takes (issue 40): W warmup, C checked replay, B a fast
step that fell back to the dispatch mode, F fast, per model family and budget.

The steps of ``benchmarks/host_cost.py`` (HF Llama, GPT-2, Mixtral, the tiny ops) and an
encoder-decoder (HF T5), each at fractions of its activation peak, ``--steps`` steps of one
fresh session each; also each plan's re-plans for the fast path and why a plan stays
checked. A structure should reach its fast path on the second replay wherever its budget
lets it (warmup, one checked replay, fast).

    .venv/bin/python benchmarks/fast_paths.py --out benchmarks/results/fast_paths.json
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import Any

import host_cost  # the steps (run as a script, ``benchmarks/`` is on the path)
import torch
from tqdm import tqdm

from hyperpar.bench import headlines
from hyperpar.bench.result_file import provenance

LETTER = {None: "W", "checked": "C", "fallback": "B", "fast": "F"}
FAMILIES = ("hf-llama", "hf-gpt2", "hf-mixtral", "hf-t5", "tiny-ops")


FAST_FLOOR = "fast_floor_105%"  # the cell 5 % above the fast-path floor


def paths(w: host_cost.Workload, fraction: float | None, steps: int) -> dict[str, Any]:
    """Paths at ``fraction`` of the peak (None: 5 % above the fast-path floor, which a
    session at half the peak reports from its checked replay)."""
    probe = host_cost._session(1e12)
    w.run(host_cost._fixed(probe))
    assert probe.last_report is not None
    peak, floor = probe.last_report.peak_resident_bytes, probe.last_report.min_feasible_budget_bytes
    if fraction is None:
        half = host_cost._session(peak * 0.5)
        for _ in range(2):
            w.run(host_cost._fixed(half))
        assert half.last_report is not None and half.last_report.fast_path_floor_bytes is not None
        fraction = half.last_report.fast_path_floor_bytes * 1.05 / peak
    session = host_cost._session(peak * fraction)
    letters = []
    for _ in range(steps):
        w.run(host_cost._fixed(session))
        assert session.last_report is not None
        letters.append(LETTER[session.last_report.replay_path])
    plans = [p for s in session._structures.values() for p in s.sizes.values()]
    first_fast = "".join(letters).find("F")
    fast_floor = session.last_report.fast_path_floor_bytes
    return {"paths": "".join(letters), "first_fast_step": first_fast if first_fast >= 0 else None,
            "budget_fraction": fraction, "floor_fraction": None if floor is None else floor / peak,
            "fast_floor_fraction": None if fast_floor is None else fast_floor / peak,
            "refinements": [p.refinements for p in plans],
            "stays_checked_because": sorted({p.fast_refusal for p in plans
                                             if p.fast_refusal and not p.packs})}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", nargs="+", default=list(FAMILIES), choices=FAMILIES)
    parser.add_argument("--fractions", nargs="+", type=float, default=[1.0, 0.5, 0.3, 0.2])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--tiny-layers", type=int, default=300)
    parser.add_argument("--out", type=Path, default=Path("hyperpar-bench/fast_paths.json"))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    logging.getLogger("hyperpar").setLevel(logging.ERROR)
    started = provenance(["benchmarks/fast_paths.py", *(sys.argv[1:] if argv is None else argv)])
    results: dict[str, dict[str, Any]] = {}
    fractions: list[float | None] = [*args.fractions, None]
    cells = [(f, x) for f in args.families for x in fractions]
    for family, fraction in tqdm(cells, desc="family x budget"):
        w = host_cost.build(family, False, args.tiny_layers)
        key = FAST_FLOOR if fraction is None else f"{round(fraction * 100)}%"
        results.setdefault(family, {})[key] = paths(w, fraction, args.steps)
    print("| family | " + " | ".join(f"{round(x * 100)} %" for x in args.fractions)
          + " | 1.05x fast-path floor | floor | fast-path floor |")
    print("|---|" + "---|" * (len(args.fractions) + 3))
    for family, row in results.items():
        floor, fast = row[FAST_FLOOR]["floor_fraction"], row[FAST_FLOOR]["fast_floor_fraction"]
        print(f"| {family} | " + " | ".join(c["paths"] for c in row.values())
              + f" | {'-' if floor is None else f'{floor:.1%}'} | {'-' if fast is None else f'{fast:.1%}'} |")
    headlines.write("fast_paths", args.out, {"steps_per_session": args.steps, "families": results}, started)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
