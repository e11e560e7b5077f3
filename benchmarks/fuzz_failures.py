"""Counts failures among the fixed-batch random programs with issue 11's data kinds
(``tests/reliability/random_program_cases.py``: the same derandomized cases CI runs), running
every case to the end instead of stopping at the first failure as the test does.

Each case runs in a child interpreter that goes on to the next case after a failure; a case
that kills the child (SIGSEGV) is counted as a crash and a new child resumes after it. With
``PYTHONPATH=<other checkout>/src`` it counts another version of hyperpar (the tests come
from this checkout)::

    .venv/bin/python benchmarks/fuzz_failures.py --out hyperpar-bench/fuzz_failures.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

CHILD = """
import sys
import torch
from hypothesis import Phase, given, settings
from hypothesis import strategies as st
from tests.reliability.program_check import BUDGETS, check_program
from tests.reliability.random_program_cases import FIXED_EXAMPLES
from tests.reliability.random_programs import data_programs

torch.set_num_threads(1)
start, n = int(sys.argv[1]), [0]

@settings(max_examples=FIXED_EXAMPLES, deadline=None, derandomize=True, database=None,
          phases=[Phase.generate])
@given(program=data_programs, budget=BUDGETS, planner=st.sampled_from(["greedy", "timed"]))
def run(program, budget, planner):
    n[0] += 1
    if n[0] < start:
        return
    print(f"CASE {n[0]} START", flush=True)
    try:
        check_program(program, budget, planner)
    except Exception as exc:
        print(f"CASE {n[0]} FAIL {type(exc).__name__}: {str(exc)[:200]!r}", flush=True)
    else:
        print(f"CASE {n[0]} OK", flush=True)

run()
print("DONE", flush=True)
"""


def count(timeout: float) -> dict[str, object]:
    outcomes: dict[int, str] = {}
    start = 1
    while True:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(
            p for p in (os.environ.get("PYTHONPATH", ""), str(ROOT)) if p)}
        done = subprocess.run([sys.executable, "-c", CHILD, str(start)], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=timeout, check=False)
        running = None
        for line in done.stdout.splitlines():
            parts = line.split(" ", 3)
            if parts[0] != "CASE":
                continue
            case = int(parts[1])
            if parts[2] == "START":
                running = case
            else:
                outcomes[case] = "ok" if parts[2] == "OK" else "wrong or error: " + parts[3]
                running = None
        if "DONE" in done.stdout:
            break
        if running is None:
            raise RuntimeError(f"the child died outside a case (code {done.returncode}):\n"
                               f"{done.stderr[-2000:]}")
        outcomes[running] = f"crash (exit code {done.returncode})"
        start = running + 1
    kinds = [v.split(" ")[0] for v in outcomes.values()]
    return {"cases": len(outcomes), "ok": kinds.count("ok"), "wrong_or_error": kinds.count("wrong"),
            "crash": kinds.count("crash"), "outcomes": {str(k): v for k, v in sorted(outcomes.items())}}


def _kept(path: Path) -> dict[str, Any]:
    """The runs already in ``path`` (without the provenance and headline rewritten here)."""
    if not path.exists():
        return {}
    return {k: v for k, v in json.loads(path.read_text()).items() if k not in ("provenance", "headline")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per child")
    parser.add_argument("--out", type=Path, default=Path("hyperpar-bench/fuzz_failures.json"))
    parser.add_argument("--label", default="after",
                        help="key of this run in --out; other keys there (before_<commit>) are kept")
    args = parser.parse_args()
    import hyperpar
    from hyperpar.bench.headlines import write
    from hyperpar.bench.result_file import provenance

    started = provenance()

    result = {"hyperpar": str(Path(hyperpar.__file__).parent), **count(args.timeout)}
    doc = _kept(args.out)
    doc[args.label] = result
    write("fuzz_failures", args.out, doc, started, indent=2)
    print(f"{result['hyperpar']}: {result['cases']} cases: {result['ok']} bitwise equal to plain, "
          f"{result['wrong_or_error']} wrong or failed, {result['crash']} crashed the interpreter")


if __name__ == "__main__":
    main()
