#!/usr/bin/env bash
# One command, fresh machine to test results: creates .venv, installs torch (CPU build,
# pinned) and hyperpar with every extra, lints, then runs the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q torch==2.13.0 -e '.[dev,hf,plot]'
.venv/bin/ruff check .
# pytest exits 5 when it collects nothing; set -e turns that into a failure.
.venv/bin/python -m pytest -q "$@"
# The session-level offload tests (bitwise, budget, divergence, failures) again with every
# session at copy_engine="auto" on the chaos copy engine: copies complete at seeded
# adversarial times and the copy rules are checked (docs/reliability.md, "Copy timing").
if [ "$#" -eq 0 ]; then
  for seed in 1 2; do
    HYPERPAR_COPY_ENGINE="chaos:$seed" .venv/bin/python -m pytest -q -p no:cacheprovider \
      tests/offload/test_*.py tests/offload/verify tests/offload/api tests/offload/disk \
      tests/reliability/test_offload_faults.py tests/reliability/test_failure_keeps_tensors_whole.py
  done
fi
