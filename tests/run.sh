#!/usr/bin/env bash
# Run the test suite: make .venv (once), install mlxq with its dev tools, lint, test
# (MLXQ_TEST_PROCS=1 for one process).
set -euo pipefail
cd "$(dirname "$0")/.."
source examples/ensure-venv.sh
.venv/bin/ruff check .
.venv/bin/ruff format --check .
# Two processes, a test file each at a time (each has its own redis-server and models):
# the fault suite, which mostly waits on leases and real processes, runs beside the rest.
exec .venv/bin/python -m pytest -q -n "${MLXQ_TEST_PROCS:-2}" --dist loadfile "$@"
