"""``hyperpar --help`` and every subcommand's help read as plain text: no reST markup."""

from __future__ import annotations

import argparse
import re
from collections.abc import Iterator

from hyperpar.cli import build_parser

MARKUP = re.compile(r"`|:(mod|func|class|meth|attr):|\*\*")


def _parsers(parser: argparse.ArgumentParser,
             name: str = "hyperpar") -> Iterator[tuple[str, argparse.ArgumentParser]]:
    yield name, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub_name, sub in action.choices.items():
                yield from _parsers(sub, f"{name} {sub_name}")


def test_every_help_is_plain_text() -> None:
    seen = dict(_parsers(build_parser()))
    assert {"hyperpar", "hyperpar demo", "hyperpar plan", "hyperpar bench", "hyperpar bench offload",
            "hyperpar bench planner", "hyperpar bench moe"} <= seen.keys()
    marked = {name: MARKUP.findall(p.format_help()) for name, p in seen.items()}
    assert not {name: found for name, found in marked.items() if found}


def test_demo_help_lists_the_exit_codes() -> None:
    text = dict(_parsers(build_parser()))["hyperpar demo"].format_help()
    assert "exit codes:" in text and "offload not judged" in text
