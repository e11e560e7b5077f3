"""One format for every benchmark's JSON: the data, where it came from, and its headline.

A result file keeps the benchmark's own keys and adds ``provenance`` (command line, git
commit and whether the tree was dirty, date, machine, torch, load average at start and
end) and ``headline``: the figures a reader sees, each one rendered into README and docs
by ``hyperpar bench table`` so that no figure is copied by hand.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any, TypedDict

import torch

log = logging.getLogger(__name__)

_REPO = Path(__file__).resolve().parents[3]


class Figure(TypedDict, total=False):
    """One headline figure; ``spread`` is [min, max] when it was measured more than once."""

    name: str
    value: float
    unit: str
    spread: list[float]
    goal: str
    better: str
    what: str
    doc: str


def figure(name: str, value: float, unit: str, what: str, doc: str, better: str = "lower",
           spread: tuple[float, float] | None = None, goal: str | None = None) -> Figure:
    """A headline entry; ``better`` is "lower" or "higher"."""
    if better not in ("lower", "higher"):
        raise ValueError(f"better must be 'lower' or 'higher', not {better!r}")
    fig = Figure(name=name, value=value, unit=unit, what=what, doc=doc, better=better)
    if spread is not None:
        fig["spread"] = [spread[0], spread[1]]
    if goal is not None:
        fig["goal"] = goal
    return fig


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", "-C", str(_REPO), *args], capture_output=True, text=True,
                             timeout=10, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip()


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _load() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def provenance(command: list[str] | None = None) -> dict[str, Any]:
    """Where a run comes from, taken when it starts; ``write_result`` adds the end load."""
    status = _git("status", "--porcelain", "--untracked-files=no")
    return {
        "command": " ".join(command if command is not None else sys.argv),
        "commit": _git("rev-parse", "--short", "HEAD"),
        "dirty": bool(status) if status is not None else None,
        "date": datetime.date.today().isoformat(),
        "machine": {"cpu_model": _cpu_model(), "cores": os.cpu_count(),
                    "torch_threads": torch.get_num_threads()},
        "torch": torch.__version__,
        "load_average": {"start": _load(), "end": None},
        "converted": False,
    }


def write_result(path: Path | str, doc: dict[str, Any], headline: list[Figure],
                 started: dict[str, Any] | None = None, indent: int = 1) -> dict[str, Any]:
    """Write ``doc`` with ``provenance`` (``started``, or taken now) and ``headline``."""
    prov = dict(started) if started is not None else provenance()
    prov["load_average"] = {**prov.get("load_average", {}), "end": _load()}
    out = {**doc, "provenance": prov, "headline": list(headline)}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=indent) + "\n")
    log.info("wrote %s (%d headline figures)", path, len(headline))
    return out
