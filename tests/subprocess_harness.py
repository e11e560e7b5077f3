"""Run Python in a fresh interpreter with a hard timeout, so that a crash (SIGSEGV, abort) or
a hang fails a test instead of killing or blocking pytest.

Several cases share one interpreter (the import of torch costs seconds): the child calls
``report_cases`` with named callables and prints a line when each case starts and how it
ended; ``case_outcome`` runs the child once per (module, function), starts another one for
the remaining cases if it died, and fails a test whose case failed or crashed. Usage::

    def cases() -> None:  # in an importable module
        report_cases({"budget 0": lambda: check(0), "budget 50": lambda: check(0.5)})

    def test_budget_0() -> None:
        case_outcome("tests.x.y", "cases", "budget 0")
"""

from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CASE = "CASE "
SKIP_ENV = "HYPERPAR_TEST_SKIP_CASES"  # JSON list of case names the child must not run again


@dataclass(frozen=True)
class Finished:
    code: int | None  # negative: killed by that signal; None: timed out
    stdout: str
    stderr: str

    def describe(self) -> str:
        if self.code is None:
            how = "did not finish in time (hang)"
        elif self.code < 0:
            how = f"was killed by {signal.Signals(-self.code).name}"
        else:
            how = f"exited with code {self.code}"
        tail = "\n".join(self.stderr.strip().splitlines()[-25:])
        return f"the child interpreter {how}; stderr tail:\n{tail}"


def run_python(code: str, timeout: float = 120.0, env: dict[str, str] | None = None) -> Finished:
    """``code`` in ``sys.executable -c`` from the repository root, one thread, fault handler on."""
    full = dict(os.environ, OMP_NUM_THREADS="1", PYTHONFAULTHANDLER="1", **(env or {}))
    try:
        done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=full, capture_output=True,
                              text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired as exc:
        def text(b: bytes | str | None) -> str:
            return b.decode(errors="replace") if isinstance(b, bytes) else (b or "")
        return Finished(None, text(exc.stdout), text(exc.stderr))
    return Finished(done.returncode, done.stdout, done.stderr)


def report_cases(cases: dict[str, Callable[[], object]]) -> None:
    """In the child: run each case not listed in ``$SKIP_ENV`` and print its outcome at once
    (a later crash keeps it)."""
    import torch

    torch.set_num_threads(1)
    skip = set(json.loads(os.environ.get(SKIP_ENV, "[]")))
    for name, case in cases.items():
        if name in skip:
            continue
        print(f"{CASE}{name} START", flush=True)
        try:
            case()
        except BaseException as exc:  # one case's failure must not hide the others'
            frames = traceback.extract_tb(exc.__traceback__)[-3:]  # where it went wrong
            where = " <- ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in reversed(frames))
            notes = " ".join(getattr(exc, "__notes__", []))  # hypothesis: the falsifying example
            text = f"{type(exc).__name__}: {exc} (at {where}) {notes}".replace("\n", " | ")
            print(f"{CASE}{name} FAIL {text}", flush=True)
        else:
            print(f"{CASE}{name} OK", flush=True)


@functools.cache
def _outcomes(module: str, function: str, timeout: float) -> dict[str, str]:
    """Case name -> "OK" or why it failed. A child that dies takes the case it was running
    with it; a new child runs the cases after that one."""
    outcomes: dict[str, str] = {}
    while True:
        done = run_python(f"from {module} import {function}\n{function}()\n", timeout,
                          env={SKIP_ENV: json.dumps(sorted(outcomes))})
        running = None
        for line in done.stdout.splitlines():
            if not line.startswith(CASE):
                continue
            rest = line[len(CASE):]
            name, failed, error = rest.partition(" FAIL ")  # case names never hold " FAIL "
            if failed:
                outcomes[name], running = error, None
            elif rest.endswith(" START"):
                running = rest[: -len(" START")]
            elif rest.endswith(" OK"):
                outcomes[rest[: -len(" OK")]], running = "OK", None
        if running is None:  # every case reported (or the child failed before the first)
            if done.code != 0:
                outcomes.setdefault("", done.describe())
            return outcomes
        outcomes[running] = done.describe()


def case_outcome(module: str, function: str, name: str, timeout: float = 180.0) -> None:
    """Fails unless case ``name`` of ``module.function()`` (run in a child) passed."""
    outcomes = _outcomes(module, function, timeout)
    assert name in outcomes, f"case {name!r} was never run: {outcomes.get('', 'no such case')}"
    assert outcomes[name] == "OK", f"case {name!r}: {outcomes[name]}"
