#!/usr/bin/env bash
# One command, fresh machine: make .venv (once), install mlxq, run the end-to-end demo.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
[ -x .venv/bin/python ] || "$PY" -m venv .venv
if [ ! -f .venv/.mlxq-installed ] || [ pyproject.toml -nt .venv/.mlxq-installed ]; then
    .venv/bin/python -m pip install -q --upgrade pip
    .venv/bin/python -m pip install -q -e ".[dev]"
    touch .venv/.mlxq-installed
fi
exec .venv/bin/python examples/demo.py "$@"
