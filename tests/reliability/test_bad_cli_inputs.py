"""Bad command lines for ``hyperpar plan|bench|demo``: a non-zero exit code and a message naming
the argument and the value, before any work starts."""

from __future__ import annotations

from pathlib import Path

import pytest

from hyperpar.cli import build_parser
from hyperpar.offload.ir import AccessKind, ActivationTrace, StorageAccess, TraceOp
from tests.reliability.cli_runner import run_cli


@pytest.fixture
def trace_file(tmp_path: Path) -> Path:
    ops = [TraceOp("a", 0.1, (StorageAccess(0, 0, AccessKind.WRITE),)),
           TraceOp("b", 0.1, (StorageAccess(1, 0, AccessKind.READ), StorageAccess(1, 1, AccessKind.WRITE))),
           TraceOp("c", 0.1, (StorageAccess(2, 1, AccessKind.READ), StorageAccess(2, 0, AccessKind.READ)))]
    path = tmp_path / "trace.json"
    ActivationTrace(ops, {0: 4096, 1: 4096}, frozenset(), 4096, 10.0, 10.0).save(path)
    return path


USAGE_CASES: list[tuple[list[str], str]] = [
    ([], "the following arguments are required: COMMAND"),
    (["train"], "argument COMMAND: invalid choice: 'train'"),
    (["plan"], "the following arguments are required: trace"),
    (["plan", "t.json", "--planner", "fast"], "argument --planner: invalid choice: 'fast'"),
    (["plan", "t.json", "--bogus"], "unrecognized arguments: --bogus"),
    (["bench"], "the following arguments are required: BENCHMARK"),
    (["bench", "disk"], "argument BENCHMARK: invalid choice: 'disk'"),
    (["bench", "moe", "--steps", "two"], "argument --steps: invalid int value: 'two'"),
    (["demo", "--steps", "0"], "argument --steps: must be >= 1, got 0"),
    (["demo", "--steps", "x"], "argument --steps"),
    (["demo", "--budget-fraction", "1.5"], "argument --budget-fraction: must be in (0, 1], got 1.5"),
    (["demo", "--budget-fraction", "0"], "argument --budget-fraction: must be in (0, 1], got 0"),
    (["demo", "--size", "huge"], "argument --size: invalid choice: 'huge'"),
    (["demo", "--batch-size", "-2"], "argument --batch-size: must be >= 1, got -2"),
    (["demo", "--moe-ranks", "0"], "argument --moe-ranks: must be >= 1, got 0"),
    (["demo", "--planner", "best"], "argument --planner: invalid choice: 'best'"),
    (["demo", "--seed", "1.5"], "argument --seed: invalid int value: '1.5'"),
]


@pytest.mark.parametrize(("argv", "text"), USAGE_CASES, ids=[" ".join(c[0]) or "<none>" for c in USAGE_CASES])
def test_usage_errors_name_the_argument(argv: list[str], text: str,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(argv, capsys)
    assert code == 2, (code, out, err)
    assert text in err, err


@pytest.mark.parametrize(("budget", "text"), [
    ("abc", "hyperpar plan: --budget-mb must be a number of MiB, got 'abc'"),
    ("-1", "hyperpar plan: --budget-mb must be finite and >= 0, got '-1'"),
    ("nan", "hyperpar plan: --budget-mb must be finite and >= 0, got 'nan'"),
    ("inf", "hyperpar plan: --budget-mb must be finite and >= 0, got 'inf'"),
])
def test_plan_budget_is_checked(budget: str, text: str, trace_file: Path, tmp_path: Path,
                                capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan", str(trace_file), f"--budget-mb={budget}", "--out", str(tmp_path / "o")]
    code, _, err = run_cli(argv, capsys)
    assert code != 0 and text in err, (code, err)
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize(("content", "text"), [
    (None, "trace file '{path}' does not exist"),
    (b"", "'{path}' is not a hyperpar trace: {path}: not valid JSON"),
    (b"\xff\xfe\x00garbage", "'{path}' is not a hyperpar trace"),
    (b'{"format": "hyperpar.schedule", "version": 1}',
     "format is 'hyperpar.schedule', expected 'hyperpar.trace'"),
    (b'{"format": "hyperpar.trace", "version": 1, "ops": []}', "missing field 'storage_sizes'"),
])
def test_plan_names_a_bad_trace_file(content: bytes | None, text: str, tmp_path: Path,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "bad.json"
    if content is not None:
        path.write_bytes(content)
    code, out, err = run_cli(["plan", str(path), "--out", str(tmp_path / "o")], capsys)
    assert code == 2, (code, out, err)
    assert text.format(path=path) in err, err


def test_plan_on_a_good_trace_succeeds(trace_file: Path, tmp_path: Path,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    """The tables above fail for the right reason: the same command with good values works."""
    code, out, err = run_cli(["plan", str(trace_file), "--budget-mb", "0.004", "--out", str(tmp_path / "o")],
                             capsys)
    assert code == 0, err
    assert f"trace {trace_file}: 3 ops, 2 storages" in out


@pytest.mark.parametrize("steps", ["0", "-3"])
def test_bench_moe_steps_must_be_positive(steps: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Regression (found here, fixed by the MoE owner): it used to be accepted and reach the ranks.
    Parsed only, so that a regression cannot spawn a benchmark."""
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(["bench", "moe", "--steps", steps])
    assert info.value.code == 2
    assert f"argument --steps: must be a positive int, got {steps}" in capsys.readouterr().err
