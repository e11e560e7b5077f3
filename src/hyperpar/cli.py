"""The ``hyperpar`` command line. Each subcommand lives in ``hyperpar.commands.<name>``.

A command module exposes ``add_arguments(parser)`` and ``run(args) -> int``; it is
imported only when chosen, so ``hyperpar --help`` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence

DESCRIPTION = ("hyperpar: planned activation offload and expert-parallel MoE for PyTorch. "
               "Run 'hyperpar COMMAND --help' for the options of one command.")

# name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("hyperpar.commands.demo", "train a small GPT without/with offload and with MoE"),
    "bench": ("hyperpar.commands.bench", "run a benchmark, or render results tables"),
    "plan": ("hyperpar.commands.plan", "plan a saved trace and print/plot the result"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hyperpar", description=DESCRIPTION)
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text)
        p.set_defaults(_module=module)
        try:
            importlib.import_module(module).add_arguments(p)
        except ModuleNotFoundError as exc:
            if exc.name != module:
                raise
            p.set_defaults(_missing=True)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    if getattr(args, "_missing", False):
        print(f"hyperpar {args.command}: not available in this build", file=sys.stderr)
        return 2
    return int(importlib.import_module(args._module).run(args) or 0)
