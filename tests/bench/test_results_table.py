"""README and docs results tables equal the render of benchmarks/results (issue 33)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

from hyperpar.bench import results_table
from hyperpar.bench.result_file import figure, provenance, write_result

ROOT = Path(__file__).resolve().parents[2]


def _check(root: Path) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "hyperpar", "bench", "table", "--check", "--root", str(root)]
    return subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=120)


def test_committed_tables_match_results() -> None:
    assert results_table.check(ROOT) == []
    done = _check(ROOT)
    assert done.returncode == 0, done.stdout + done.stderr


def test_edited_headline_fails_naming_the_row(tmp_path: Path) -> None:
    shutil.copy(ROOT / "README.md", tmp_path / "README.md")
    shutil.copytree(ROOT / "docs", tmp_path / "docs")
    shutil.copytree(ROOT / "benchmarks" / "results", tmp_path / "benchmarks" / "results")
    path = tmp_path / "benchmarks" / "results" / "variable_lengths.json"
    doc = json.loads(path.read_text())
    fig = next(f for f in doc["headline"] if f["name"] == "random_over_fixed")
    fig["value"] = 0.99
    path.write_text(json.dumps(doc))
    done = _check(tmp_path)
    assert done.returncode == 1
    assert "README.md: row 'variable_lengths.json: random_over_fixed'" in done.stdout
    assert "docs/variable_shapes.md: row 'variable_lengths.json: random_over_fixed'" in done.stdout
    assert "hyperpar bench table" in done.stdout
    results_table.render(tmp_path)
    assert results_table.check(tmp_path) == []


def test_write_result_records_provenance_and_headline(tmp_path: Path) -> None:
    started = provenance(["bench", "x"])
    out = write_result(tmp_path / "r.json", {"data": 1},
                       [figure("f", 1.5, "x", "a figure", "docs/index.md", spread=(1.0, 2.0))], started)
    back = json.loads((tmp_path / "r.json").read_text())
    assert back == out and back["data"] == 1
    prov = back["provenance"]
    assert prov["command"] == "bench x" and prov["converted"] is False
    assert {"cpu_model", "cores", "torch_threads"} <= prov["machine"].keys()
    assert back["headline"][0]["spread"] == [1.0, 2.0]


def test_every_cited_key_exists_in_its_result_file() -> None:
    assert results_table.bad_citations(ROOT) == []


def test_a_citation_of_a_missing_key_is_reported(tmp_path: Path) -> None:
    shutil.copytree(ROOT / "benchmarks" / "results", tmp_path / "benchmarks" / "results")
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "x.md").write_text(
        "ok `variable_lengths.json: random_over_fixed`, `variable_lengths.json: at_step.300.held_mib`,\n"
        "`host_cost.json: steps.tiny-ops.over_plain.replay_50.median`; bad `variable_lengths.json: nope`,\n"
        "`variable_lengths.json: at_step.9999`, `missing.json: x`\n")
    assert results_table.bad_citations(tmp_path) == [
        "docs/x.md: `variable_lengths.json: nope`", "docs/x.md: `variable_lengths.json: at_step.9999`",
        "docs/x.md: `missing.json: x`"]
