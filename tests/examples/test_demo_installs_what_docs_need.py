"""README promises that after ``bash scripts/demo.sh`` every documented command runs as written
with the venv's programs. This checks it statically (no fresh venv): every package a
documented script or module imports, or that its KNOWN entry needs, belongs to an extra that
scripts/demo.sh installs, in the same pip command that pins torch (so pip keeps the CPU build)."""

from __future__ import annotations

import re
import shlex
from itertools import pairwise
from pathlib import Path

from tests.examples.test_documented_commands import KNOWN, ROOT, Run, documented

PINNED_TORCH = "torch==2.13.0"
# third-party import -> the pyproject extra that provides it
EXTRA_OF = {"transformers": "hf", "accelerate": "hf", "matplotlib": "plot", "pytest": "dev",
            "hypothesis": "dev", "torchtitan": "bench"}
IMPORT = re.compile(r"^\s*(?:from|import)\s+(\w+)", re.M)


def demo_extras() -> set[str]:
    """The extras of the pip command in scripts/demo.sh that installs hyperpar."""
    lines = [line for line in (ROOT / "scripts" / "demo.sh").read_text().splitlines()
             if "pip install" in line and "-e" in line]
    assert len(lines) == 1, f"expected one pip install of hyperpar in scripts/demo.sh, got {lines}"
    assert PINNED_TORCH in shlex.split(lines[0]), f"torch must stay pinned in the same command: {lines[0]}"
    found = re.search(r"-e\s+'?\.\[([\w,\s]*)\]", lines[0])
    return set() if found is None else {extra.strip() for extra in found.group(1).split(",")}


def _sources(command: str) -> list[Path]:
    """The Python files a command runs: ``*.py`` arguments and ``-m`` modules of this repository."""
    words = shlex.split(command)
    files = [ROOT / w for w in words if w.endswith(".py")]
    for flag, module in pairwise(words):
        if flag == "-m":
            files += [p for p in (ROOT / "src" / Path(*module.split(".")), ROOT / Path(*module.split(".")))
                      for p in (p.with_suffix(".py"), p / "__main__.py") if p.is_file()]
    return [f for f in files if f.is_file()]


def needed_extras(command: str) -> set[str]:
    words = shlex.split(command)
    needs = {EXTRA_OF["pytest"]} if "pytest" in words else set()
    plan = KNOWN.get(command)
    if isinstance(plan, Run) and plan.needs == "hf":
        needs.add("hf")
    for source in _sources(command):
        needs |= {EXTRA_OF[name] for name in IMPORT.findall(source.read_text()) if name in EXTRA_OF}
    return needs


def test_the_demo_installs_every_extra_a_documented_command_needs() -> None:
    extras = demo_extras()
    runnable, _ = documented()
    missing = {command: sorted(needed_extras(command) - extras) for command in runnable}
    missing = {command: need for command, need in missing.items() if need}
    assert not missing, (f"scripts/demo.sh installs .[{','.join(sorted(extras))}] but these documented "
                         f"commands need more: {missing}")


def test_the_mixtral_example_is_seen_to_need_hf() -> None:
    """The check itself can fail: the example README runs with torchrun imports transformers."""
    assert "hf" in needed_extras(".venv/bin/torchrun --nproc-per-node 2 examples/moe_hf_mixtral.py")


def test_the_demo_installs_what_the_suite_runs_the_readme_blocks_in() -> None:
    """The documented-commands test runs every README block (at a tiny size) in the venv
    scripts/test.sh makes; the demo's set-up installs the same set, so those runs stand for
    runs after the demo alone."""
    def install_line(script: str) -> str:
        lines = [line.strip() for line in (ROOT / "scripts" / script).read_text().splitlines()
                 if "pip install" in line and "-e" in line]
        assert len(lines) == 1, (script, lines)
        return lines[0]

    assert install_line("demo.sh") == install_line("test.sh")
