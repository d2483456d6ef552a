#!/usr/bin/env bash
# Run the test suite: make .venv (once), install mlxq with its dev tools, lint, test
# (MLXQ_TEST_PROCS=1 for one process).
set -euo pipefail
cd "$(dirname "$0")/.."
source examples/ensure-venv.sh
.venv/bin/ruff check .
.venv/bin/ruff format --check .
# MLX's Linux CPU wheel ships a slow reference BLAS: OpenBLAS preloaded where there is one
# (Debian's, which .ci/run installs, or the venv's own); the suite passes on either.
source examples/blas.sh
# One BLAS thread per process: the two test processes (and the workers they start) fill
# the cores; OpenBLAS's spinning threads on top of them cost ~6% of the suite's time here.
export OPENBLAS_NUM_THREADS="${OPENBLAS_NUM_THREADS:-1}"
# Two processes, a test file each at a time (each has its own redis-server and models):
# the fault suite runs beside the rest.
exec .venv/bin/python -m pytest -q -n "${MLXQ_TEST_PROCS:-2}" --dist loadfile "$@"
