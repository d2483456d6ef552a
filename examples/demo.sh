#!/usr/bin/env bash
# One command, fresh machine: make .venv (once), install mlxq, run the end-to-end demo.
set -euo pipefail
cd "$(dirname "$0")/.."
source examples/ensure-venv.sh
source examples/blas.sh  # Linux: OpenBLAS in front of MLX's slow reference BLAS
exec .venv/bin/python examples/demo.py "$@"
