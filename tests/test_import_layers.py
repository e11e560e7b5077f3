"""No import circles among hyperpar's modules, lazy imports included.

A function-level import hides a circle from Python but not from a reader: the two files
still need each other. This parses every module under src/hyperpar with ``ast`` (no
imports run), builds the module graph from every ``import``/``from ... import`` wherever
it stands, and fails naming each circle it finds.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = "hyperpar"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _resolve(name: str, modules: set[str]) -> str | None:
    """The longest prefix of a dotted name that is one of our modules."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def _imports_of(path: Path, module: str, modules: set[str]) -> set[str]:
    """Our modules that ``module`` imports, at any level of the file."""
    is_package = path.name == "__init__.py"
    base = module if is_package else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                anchor = base.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                stem = ".".join([*anchor, node.module] if node.module else anchor)
            else:
                stem = node.module or ""
            # `from pkg import name` imports pkg.name when that is a module, else pkg.
            names = [f"{stem}.{alias.name}" for alias in node.names]
        else:
            continue
        for name in names:
            target = _resolve(name, modules)
            if target is not None and target != module:
                found.add(target)
    return found


def _graph() -> dict[str, set[str]]:
    paths = {_module_name(p): p for p in (SRC / PACKAGE).rglob("*.py")}
    modules = set(paths)
    return {m: _imports_of(p, m, modules) for m, p in paths.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    counter = 0

    def visit(node: str) -> None:
        nonlocal counter
        index[node] = low[node] = counter
        counter += 1
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return components


def test_graph_sees_lazy_imports() -> None:
    graph = _graph()
    assert "hyperpar.offload.capture.checked.replay" in graph
    assert graph["hyperpar.offload.capture.checked.replay"], "the parser found no imports"


def test_no_import_cycles_among_hyperpar_modules() -> None:
    cycles = _cycles(_graph())
    assert not cycles, "import circles (function-level imports count):\n" + "\n".join(
        " <-> ".join(c) for c in cycles
    )


# capture's rooms, lowest first: each may import only from the rooms below it (and itself)
CAPTURE = "hyperpar.offload.capture"
CAPTURE_ROOMS = ("ops", "mode", "tracing", "checked", "fast")
MAX_CAPTURE_LINES = 420


def _room(module: str) -> str | None:
    rest = module.removeprefix(CAPTURE + ".")
    return rest.split(".")[0] if rest != module and rest.split(".")[0] in CAPTURE_ROOMS else None


def test_capture_rooms_import_only_downward() -> None:
    graph = _graph()
    rooms = {m: _room(m) for m in graph}
    assert {r for r in rooms.values() if r} == set(CAPTURE_ROOMS), "a room has no modules"
    loose = [m for m in graph if m.startswith(CAPTURE + ".") and rooms[m] is None]
    assert not loose, f"capture modules outside its rooms: {loose}"
    upward = [(m, t) for m, targets in graph.items() if rooms[m] for t in targets
              if rooms[t] and CAPTURE_ROOMS.index(rooms[t]) > CAPTURE_ROOMS.index(rooms[m])]
    assert not upward, "capture imports pointing up its rooms (" + " < ".join(CAPTURE_ROOMS) + "):\n" + \
        "\n".join(f"{m} -> {t}" for m, t in upward)


def test_capture_files_stay_small() -> None:
    long = {str(p.relative_to(SRC)): n for p in (SRC / PACKAGE / "offload" / "capture").rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_CAPTURE_LINES}
    assert not long, f"capture files over {MAX_CAPTURE_LINES} lines: {long}"
