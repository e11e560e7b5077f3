"""Render the headline figures of ``benchmarks/results/*.json`` into README and docs tables.

A page holds generated blocks between markers: ``<!-- results:begin -->`` (README: every
result file in ``README_ORDER``) or ``<!-- results:<stem>:begin -->`` (one file's
figures, on its docs page). ``render`` rewrites them; ``check`` lists the rows of a
committed block that differ from the render of the committed JSON, so the numbers a
reader sees and the files they come from cannot drift apart.
"""

from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

RESULTS = Path("benchmarks/results")
PAGES = ("README.md", "docs/*.md")
README_ORDER = ("moe", "offload", "planner", "variable_lengths", "variable_shapes_models", "compile",
                "multicore_hang_paths", "fuzz_failures", "replay_instructions",
                "replay_overhead_cpu", "tiny_ops", "warmup_budget", "grown_steps", "host_cost",
                "gpu_projection", "whole_model_projection", "recompute_cpu", "disk_store", "disk_tier")
HEADER = ("| what was measured | value [spread] | goal | command | machine, date | detail |\n"
          "|---|---|---|---|---|---|")
_BLOCK = re.compile(r"(<!-- results(?::(?P<stem>[\w.-]+))?:begin -->\n)(?P<body>.*?)"
                    r"(<!-- results(?::(?P=stem))?:end -->)", re.S)


@dataclass
class Difference:
    """A row of a page's block that the render of the JSON does not reproduce."""

    page: str
    row: str

    def __str__(self) -> str:
        return f"{self.page}: row {self.row!r} differs from benchmarks/results"


def _num(v: float) -> str:
    if isinstance(v, int) or float(v).is_integer():
        return f"{int(v):,}"
    a = abs(v)
    return f"{v:,.0f}" if a >= 100 else f"{v:.1f}" if a >= 10 else f"{v:.2f}"


def _value(fig: dict[str, Any]) -> str:
    unit = "" if fig["unit"] == "x" else f" {fig['unit']}"
    text = f"**{_num(fig['value'])}**{unit}"
    if "spread" in fig:
        text += f" [{_num(fig['spread'][0])}-{_num(fig['spread'][1])}]"
    return text


def _machine(prov: dict[str, Any]) -> str:
    m, load = prov.get("machine", {}), prov.get("load_average", {})
    parts = [f"{m.get('cores') or '?'} CPUs"]
    if m.get("torch_threads"):
        parts.append(f"{m['torch_threads']} thread{'s' if m['torch_threads'] != 1 else ''}")
    parts.append(f"torch {prov.get('torch') or '?'}")
    loads = [x for x in (load.get("start"), load.get("end")) if x]
    if loads:
        ones = [x[0] for x in loads]
        parts.append(f"load {min(ones):.1f}" + (f"-{max(ones):.1f}" if max(ones) - min(ones) >= 0.05 else ""))
    stamp = f"{prov.get('date') or '?'}, {prov.get('commit') or '?'}"
    if prov.get("dirty"):
        stamp += "+dirty"
    if prov.get("converted"):
        stamp += " (converted)"
    return ", ".join(parts) + "; " + stamp


def _link(doc: str, page: str) -> str:
    path, _, anchor = doc.partition("#")
    rel = os.path.relpath(path, os.path.dirname(page) or ".")
    return f"[{Path(path).name}]({rel}{'#' + anchor if anchor else ''})"


def row_id(stem: str, fig: dict[str, Any]) -> str:
    """How a row is named: the result file and the headline key, as prose should cite it."""
    return f"{stem}.json: {fig['name']}"


def rows(stem: str, result: dict[str, Any], page: str) -> list[tuple[str, str]]:
    """(row id, markdown row) for each headline figure of one result file."""
    prov = result.get("provenance", {})
    out = []
    for fig in result.get("headline", []):
        cells = [fig["what"], _value(fig), fig.get("goal", ""), f"`{prov.get('command', '?')}`",
                 _machine(prov), f"{_link(fig['doc'], page)} `{row_id(stem, fig)}`"]
        out.append((row_id(stem, fig), "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"))
    return out


def load_results(root: Path) -> dict[str, dict[str, Any]]:
    """Every committed result file that has a headline, by stem."""
    found = {}
    for path in sorted((root / RESULTS).glob("*.json")):
        data = json.loads(path.read_text())
        if isinstance(data, dict) and data.get("headline"):
            found[path.stem] = data
    return found


def _block_rows(stem: str | None, results: dict[str, dict[str, Any]], page: str) -> list[tuple[str, str]]:
    stems = README_ORDER if stem is None else (stem,)
    missing = [s for s in stems if s not in results]
    if missing:
        raise KeyError(f"{page}: no headline in benchmarks/results for {', '.join(missing)}")
    return [r for s in stems for r in rows(s, results[s], page)]


def _pages(root: Path) -> list[Path]:
    return [p for pattern in PAGES for p in sorted(root.glob(pattern))]


def render(root: Path) -> list[str]:
    """Rewrite every block on every page; returns the pages that changed."""
    results, changed = load_results(root), []
    for path in _pages(root):
        page = path.relative_to(root).as_posix()
        text = path.read_text()

        def fill(m: re.Match[str], page: str = page) -> str:
            body = "\n".join([HEADER, *(line for _, line in _block_rows(m["stem"], results, page))])
            return f"{m.group(1)}{body}\n{m.group(4)}"

        new = _BLOCK.sub(fill, text)
        if new != text:
            path.write_text(new)
            changed.append(page)
            log.info("rendered results into %s", page)
    return changed


def check(root: Path) -> list[Difference]:
    """Rows of committed blocks that differ from the render of the committed JSON."""
    results, diffs = load_results(root), []
    for path in _pages(root):
        page = path.relative_to(root).as_posix()
        for m in _BLOCK.finditer(path.read_text()):
            have = set(m["body"].splitlines())
            want = _block_rows(m["stem"], results, page)
            diffs += [Difference(page, rid) for rid, line in want if line not in have]
            wanted = {line for _, line in want} | set(HEADER.splitlines())
            diffs += [Difference(page, f"unexpected: {line[:60]}") for line in m["body"].splitlines()
                      if line.strip() and line not in wanted]
    return diffs


_CITATION = re.compile(r"`(?P<file>[\w.-]+\.json): (?P<key>[^`]+)`")


def _resolve(node: Any, path: str) -> bool:
    """Whether dotted ``path`` names something in ``node``; a key may itself hold dots."""
    if not path:
        return True
    if isinstance(node, list):
        head, _, rest = path.partition(".")
        return head.isdigit() and int(head) < len(node) and _resolve(node[int(head)], rest)
    if not isinstance(node, dict):
        return False
    parts = path.split(".")
    return any(".".join(parts[:i]) in node and _resolve(node[".".join(parts[:i])], ".".join(parts[i:]))
               for i in range(len(parts), 0, -1))


def bad_citations(root: Path) -> list[str]:
    """Citations ``name.json: key`` on the pages whose key is neither a headline name of
    ``benchmarks/results/name.json`` nor a dotted path into it (or whose file is missing)."""
    bad, docs = [], {}
    for path in _pages(root):
        page = path.relative_to(root).as_posix()
        for m in _CITATION.finditer(path.read_text()):
            name, key = m["file"], m["key"].strip()
            if name not in docs:
                file = root / RESULTS / name
                docs[name] = json.loads(file.read_text()) if file.exists() else None
            doc = docs[name]
            names = {f["name"] for f in doc.get("headline", [])} if isinstance(doc, dict) else set()
            if doc is None or (key not in names and not _resolve(doc, key)):
                bad.append(f"{page}: `{name}: {key}`")
    return bad
