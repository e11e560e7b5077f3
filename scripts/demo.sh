#!/usr/bin/env bash
# One command, fresh machine to the demo: creates .venv, installs torch (CPU build, pinned)
# and hyperpar with every extra a documented command needs (plot; hf for the transformers
# examples; dev for the pytest and hypothesis ones: README says each runs after this script
# alone, checked by tests/examples/test_demo_installs_what_docs_need.py), then runs
# `hyperpar demo` (arguments pass through, e.g. `bash scripts/demo.sh --steps 2 --no-moe`).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q torch==2.13.0 -e '.[dev,hf,plot]'
exec .venv/bin/hyperpar demo "$@"
