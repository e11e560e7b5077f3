"""``hyperpar bench table [--check]``: README and docs results tables from the result files."""

from __future__ import annotations

import argparse
from pathlib import Path

from hyperpar.bench import results_table


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--root", type=Path, default=Path("."),
                        help="repository root holding README.md, docs/ and benchmarks/results/")
    parser.add_argument("--check", action="store_true",
                        help="change nothing; exit 1 naming each row that differs from the JSON "
                             "and each cited 'name.json: key' that the file does not hold")


def run(args: argparse.Namespace) -> int:
    root = args.root.resolve()
    if not args.check:
        for page in results_table.render(root):
            print(f"rendered {page}")
        return 0
    diffs = results_table.check(root)
    for diff in diffs:
        print(diff)
    if diffs:
        print(f"re-render with: python -m hyperpar bench table --root {args.root}")
    bad = results_table.bad_citations(root)
    for cite in bad:
        print(f"{cite}: no such key in benchmarks/results")
    if diffs or bad:
        return 1
    print("results tables match benchmarks/results, and every cited key exists")
    return 0
