"""``hyperpar bench offload|planner|moe|table``: each benchmark lives in ``hyperpar.bench.<name>``.

A benchmark module exposes ``add_arguments(parser)`` and ``run(args) -> int`` like a
command, with an ``--out`` option for its JSON. Whatever default it gives, the JSON goes
to ``./hyperpar-bench/<name>.json`` unless ``--out`` says otherwise: the committed
``benchmarks/results/*.json`` change only when a run is asked to write there. ``table``
is not a benchmark: it renders those files' headline figures into README and docs.
"""

from __future__ import annotations

import argparse
import importlib
from pathlib import Path

from hyperpar.commands import bench_table

SCRATCH = Path("hyperpar-bench")

BENCHMARKS = {
    "offload": "replay vs plain step time and memory on the package's GPT",
    "planner": "TimedPlanner vs GreedyPlanner on traces of real models",
    "moe": "MoeExperts vs a naive expert-parallel baseline on gloo ranks",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="benchmark", required=True, metavar="BENCHMARK")
    for name, help_text in BENCHMARKS.items():
        p = sub.add_parser(name, help=help_text)
        p.set_defaults(_bench_module=f"hyperpar.bench.{name}")
        try:
            importlib.import_module(f"hyperpar.bench.{name}").add_arguments(p)
        except ModuleNotFoundError as exc:
            if exc.name != f"hyperpar.bench.{name}":
                raise
            p.set_defaults(_bench_missing=True)
            continue
        _scratch_out(p, name)
    table = sub.add_parser("table", help="render README/docs results tables from benchmarks/results")
    table.set_defaults(_bench_table=True)
    bench_table.add_arguments(table)


def _scratch_out(parser: argparse.ArgumentParser, name: str) -> None:
    default = SCRATCH / f"{name}.json"
    out = next((a for a in parser._actions if a.dest == "out"), None)
    if out is None:
        raise RuntimeError(f"hyperpar.bench.{name} has no --out option")
    out.default = default
    out.help = (f"the JSON result (default {default}; benchmarks/results/{name}.json updates the "
                f"committed results)")


def run(args: argparse.Namespace) -> int:
    if getattr(args, "_bench_table", False):
        return bench_table.run(args)
    if getattr(args, "_bench_missing", False):
        raise SystemExit(f"hyperpar bench {args.benchmark}: not available in this build")
    return int(importlib.import_module(args._bench_module).run(args) or 0)
