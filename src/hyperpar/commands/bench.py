"""``hyperpar bench offload|planner|moe``: each benchmark lives in ``hyperpar.bench.<name>``.

A benchmark module exposes ``add_arguments(parser)`` and ``run(args) -> int`` like a
command, and writes its JSON under ``benchmarks/results/`` (or ``--out``).
"""

from __future__ import annotations

import argparse
import importlib

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


def run(args: argparse.Namespace) -> int:
    if getattr(args, "_bench_missing", False):
        raise SystemExit(f"hyperpar bench {args.benchmark}: not available in this build")
    return int(importlib.import_module(args._bench_module).run(args) or 0)
