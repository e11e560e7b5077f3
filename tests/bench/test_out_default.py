"""Committed results change only when asked: every benchmark's JSON defaults to ./hyperpar-bench/."""

from __future__ import annotations

from pathlib import Path

import pytest

from hyperpar.cli import build_parser
from hyperpar.commands.bench import BENCHMARKS


@pytest.mark.parametrize("name", sorted(BENCHMARKS))
def test_default_out_is_a_scratch_file(name: str) -> None:
    parser = build_parser()
    args = parser.parse_args(["bench", name])
    assert args.out == Path("hyperpar-bench") / f"{name}.json"
    asked = parser.parse_args(["bench", name, "--out", f"benchmarks/results/{name}.json"])
    assert asked.out == Path(f"benchmarks/results/{name}.json")


def test_scratch_folder_is_ignored_by_git() -> None:
    ignored = (Path(__file__).resolve().parents[2] / ".gitignore").read_text().split()
    assert "hyperpar-bench/" in ignored
