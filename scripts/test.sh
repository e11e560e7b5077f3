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
