#!/usr/bin/env bash
# Run the test suite: make .venv (once), install mlxq with its dev tools, lint, test.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
[ -x .venv/bin/python ] || "$PY" -m venv .venv
if [ ! -f .venv/.mlxq-installed ] || [ pyproject.toml -nt .venv/.mlxq-installed ]; then
    .venv/bin/python -m pip install -q --upgrade pip
    .venv/bin/python -m pip install -q -e ".[dev]"
    touch .venv/.mlxq-installed
fi
.venv/bin/ruff check .
.venv/bin/ruff format --check .
exec .venv/bin/python -m pytest -q "$@"
