#!/usr/bin/env bash
# One command, fresh machine to the demo: creates .venv, installs torch (CPU build, pinned)
# and hyperpar with the plot extra, then runs `hyperpar demo` (arguments pass through,
# e.g. `bash scripts/demo.sh --steps 2 --no-moe`).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q torch==2.13.0 -e '.[plot]'
exec .venv/bin/hyperpar demo "$@"
