"""Bring result files written before the headline format into it, once, without re-running.

Each file keeps its keys and gains ``headline`` (from ``hyperpar.bench.headlines``) and a
``provenance`` marked ``converted``: commit and date of the commit that last changed the
file, and the command, machine and load the file itself recorded. Files that already have
a provenance are left alone.

    PYTHONPATH=src python scripts/convert_results.py benchmarks/results/*.json
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

from hyperpar.bench.headlines import headline


def _git_log(path: Path, fmt: str) -> str | None:
    out = subprocess.run(["git", "log", "-1", f"--format={fmt}", "--", str(path)],
                         capture_output=True, text=True, check=True).stdout.strip()
    return out or None


def _find(doc: Any, keys: tuple[str, ...]) -> Any:
    """The first value under one of ``keys``, at the top or else in the last sub-dict having it
    (a before/after file describes its latest run last)."""
    if not isinstance(doc, dict):
        return None
    for k in keys:
        if doc.get(k) is not None:
            return doc[k]
    for v in reversed(list(doc.values())):
        if isinstance(v, dict):
            for k in keys:
                if v.get(k) is not None:
                    return v[k]
    return None


def _machine(doc: dict[str, Any]) -> dict[str, Any]:
    m = doc.get("machine")
    text = json.dumps(m) if m is not None else ""
    cores = _find(m, ("cpu_count", "cpus")) or doc.get("cpus")
    if cores is None and (hit := re.search(r"(\d+) cpus", text, re.I)):
        cores = int(hit.group(1))
    threads = _find(m, ("torch_threads", "threads")) or doc.get("threads") or doc.get("threads_per_rank")
    if threads is None and (hit := re.search(r"(\d+) (?:torch )?thread", text)):
        threads = int(hit.group(1))
    return {"cpu_model": None, "cores": cores or 2, "torch_threads": threads}


def _load(doc: dict[str, Any]) -> list[float] | None:
    load = _find(doc, ("load_average", "load_avg_at_start", "load_average_1min"))
    if isinstance(load, list) and load and isinstance(load[0], (int, float)):
        return [round(x, 2) for x in load]
    return None


def convert(path: Path) -> bool:
    """Add provenance and headline to one file; False when it already had them."""
    doc = json.loads(path.read_text())
    if "provenance" in doc:
        return False
    load = _load(doc)
    doc["provenance"] = {
        "command": _find(doc, ("command",)) or "not recorded",
        "commit": _git_log(path, "%h"),
        "dirty": None,
        "date": _git_log(path, "%cs"),
        "machine": _machine(doc),
        "torch": _find(doc, ("torch",)),
        "load_average": {"start": load, "end": None},
        "converted": True,
    }
    doc["headline"] = headline(path.stem, doc)
    path.write_text(json.dumps(doc, indent=1) + "\n")
    return True


if __name__ == "__main__":
    for name in sys.argv[1:]:
        print(("converted " if convert(Path(name)) else "kept ") + name)
