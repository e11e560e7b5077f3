"""Corrupted trace and schedule files: ``load`` raises ``IRFormatError`` naming the file and the
field, never a bare KeyError/TypeError from deep inside; random damage is fuzzed too."""

from __future__ import annotations

import copy
import json
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hyperpar.offload.ir import ActivationTrace, IRFormatError, ResidencySchedule
from hyperpar.offload.planning import get_planner
from tests.offload.planning.random_traces import random_trace


def _trace() -> ActivationTrace:
    return random_trace(random.Random(7), max_ops=12)


def _docs() -> tuple[dict[str, Any], dict[str, Any]]:
    trace = _trace()
    return ({"format": "hyperpar.trace", "version": 1, **trace.to_dict()},
            {"format": "hyperpar.schedule", "version": 1, **get_planner("greedy").build(trace).to_dict()})


def _set(path: tuple[Any, ...], value: Any) -> Callable[[dict[str, Any]], None]:
    def change(doc: dict[str, Any]) -> None:
        target: Any = doc
        for key in path[:-1]:
            target = target[key]
        if value is _DELETE:
            del target[path[-1]]
        else:
            target[path[-1]] = value
    return change


_DELETE = object()
TRACE_CASES: list[tuple[str, Callable[[dict[str, Any]], None], str]] = [
    ("no format", _set(("format",), _DELETE), "format is None, expected 'hyperpar.trace'"),
    ("version", _set(("version",), 99), "version 99 is not supported (expected 1)"),
    ("no ops", _set(("ops",), _DELETE), "missing field 'ops'"),
    ("ops type", _set(("ops",), {"0": 1}), "field 'ops' must be list"),
    ("op type", _set(("ops", 0), "op"), "ops[0]: expected an object, got 'op'"),
    ("op name", _set(("ops", 0, "name"), 7), "ops[0]: field 'name' must be str, got 7"),
    ("duration", _set(("ops", 0, "duration_ms"), -1.0), "ops[0].duration_ms: expected a finite non-negative"),
    ("duration nan", _set(("ops", 0, "duration_ms"), float("nan")), "ops[0].duration_ms"),
    ("duration bool", _set(("ops", 0, "duration_ms"), True),
     "ops[0]: field 'duration_ms' must be int or float"),
    ("access pair", _set(("ops", 0, "accesses"), [[0]]), "ops[0].accesses[0]: expected [sid, kind], got [0]"),
    ("access sid", _set(("ops", 0, "accesses"), [[999, "write"]]),
     "ops[0].accesses[0]: storage 999 has no size"),
    ("access neg", _set(("ops", 0, "accesses"), [[-1, "write"]]),
     "ops[0].accesses[0] sid: expected a non-negative"),
    ("access kind", _set(("ops", 0, "accesses"), [[0, "modify"]]),
     "ops[0].accesses[0]: unknown kind 'modify'"),
    ("sizes type", _set(("storage_sizes",), [1, 2]), "field 'storage_sizes' must be dict"),
    ("size key", _set(("storage_sizes", "x"), 4), "storage_sizes key 'x' is not an integer"),
    ("size value", _set(("storage_sizes", "0"), -5),
     "storage_sizes[0]: expected a non-negative integer, got -5"),
    ("retained", _set(("retained_sids",), ["a"]), "retained_sids: expected a non-negative integer, got 'a'"),
    ("limit bool", _set(("memory_limit_bytes",), True), "field 'memory_limit_bytes' must be int, got True"),
    ("limit neg", _set(("memory_limit_bytes",), -1), "memory_limit_bytes: expected a non-negative integer"),
    ("bandwidth", _set(("d2h_bandwidth_gbps",), "fast"), "field 'd2h_bandwidth_gbps' must be int or float"),
    ("guides", _set(("guides",), [{}]), "guides[0]"),
]


@pytest.mark.parametrize(("name", "change", "text"), TRACE_CASES, ids=[c[0] for c in TRACE_CASES])
def test_corrupted_trace_is_named(name: str, change: Callable[[dict[str, Any]], None], text: str,
                                  tmp_path: Path) -> None:
    doc = _docs()[0]
    change(doc)
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(IRFormatError) as info:
        ActivationTrace.load(path)
    assert str(path) in str(info.value) and text in str(info.value), str(info.value)


SCHEDULE_CASES: list[tuple[str, Callable[[dict[str, Any]], None], str]] = [
    ("format", _set(("format",), "hyperpar.trace"),
     "format is 'hyperpar.trace', expected 'hyperpar.schedule'"),
    ("no pre", _set(("pre",), _DELETE), "missing field 'pre'"),
    ("row type", _set(("pre", 0), "x"), "pre[0] is not a list"),
    ("entry", _set(("post", 0), [["copy_d2h"]]), "post[0] entry ['copy_d2h'] is not [kind, sid]"),
    ("action", _set(("post", 0), [["teleport", 0]]), "post[0] unknown action 'teleport'"),
    ("sid", _set(("post", 0), [["copy_d2h", -2]]), "expected a non-negative integer, got -2"),
    ("lengths", _set(("post",), []), "pre has"),
    ("budget", _set(("budget_bytes",), "lots"), "budget_bytes: expected a non-negative integer, got 'lots'"),
    ("deficit op", _set(("deficit_op",), -1), "expected a non-negative integer, got -1"),
]


@pytest.mark.parametrize(("name", "change", "text"), SCHEDULE_CASES, ids=[c[0] for c in SCHEDULE_CASES])
def test_corrupted_schedule_is_named(name: str, change: Callable[[dict[str, Any]], None], text: str,
                                     tmp_path: Path) -> None:
    doc = _docs()[1]
    change(doc)
    path = tmp_path / "schedule.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(IRFormatError) as info:
        ResidencySchedule.load(path)
    assert str(path) in str(info.value) and text in str(info.value), str(info.value)


@pytest.mark.parametrize("raw", [b"", b"{", b"[1, 2]", b"null", b'"trace"'])
def test_not_a_json_object(raw: bytes, tmp_path: Path) -> None:
    path = tmp_path / "trace.json"
    path.write_bytes(raw)
    with pytest.raises(IRFormatError, match=r"not valid JSON|expected a JSON object"):
        ActivationTrace.load(path)


def test_binary_garbage_is_named(tmp_path: Path) -> None:
    """Regression (found here, fixed in the IR): a bare UnicodeDecodeError without the path."""
    path = tmp_path / "trace.json"
    path.write_bytes(b"\xff\xfe\x00\x81 not text")
    with pytest.raises(IRFormatError) as info:
        ActivationTrace.load(path)
    assert str(path) in str(info.value)


def _mutate(doc: Any, rng: random.Random) -> Any:
    """Replace, delete or retype one random node of the JSON tree."""
    nodes: list[tuple[Any, Any]] = []

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                nodes.append((node, key))
                walk(value)
        elif isinstance(node, list):
            for i, value in enumerate(node):
                nodes.append((node, i))
                walk(value)

    walk(doc)
    parent, key = rng.choice(nodes)
    junk = rng.choice([None, True, -1, 2**40, 1.5, float("inf"), "x", [], {}, [[0, "read"]], {"0": 1}])
    if isinstance(parent, dict) and rng.random() < 0.3:
        del parent[key]
    else:
        parent[key] = junk
    return doc


@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(rng=st.randoms(use_true_random=False), which=st.sampled_from(["trace", "schedule"]),
       edits=st.integers(1, 3))
def test_random_damage_is_either_loaded_or_named(rng: random.Random, which: str, edits: int) -> None:
    trace_doc, schedule_doc = _docs()
    doc = copy.deepcopy(trace_doc if which == "trace" else schedule_doc)
    for _ in range(edits):
        doc = _mutate(doc, rng)
    try:
        if which == "trace":
            ActivationTrace.from_dict(doc, where="damaged")
        else:
            ResidencySchedule.from_dict(doc, where="damaged")
    except IRFormatError as exc:
        assert str(exc).startswith("damaged"), str(exc)
