#!/usr/bin/env bash
# Run the test suite: make .venv (once), install mlxq with its dev tools, lint, test.
set -euo pipefail
cd "$(dirname "$0")/.."
source examples/ensure-venv.sh
.venv/bin/ruff check .
.venv/bin/ruff format --check .
exec .venv/bin/python -m pytest -q "$@"
