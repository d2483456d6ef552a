#!/usr/bin/env bash
# One command, fresh machine: make .venv (once), install mlxq, run the end-to-end demo.
set -euo pipefail
cd "$(dirname "$0")/.."
source examples/ensure-venv.sh
# MLX's Linux CPU wheel ships a slow reference BLAS: OpenBLAS is ~3x faster on the real model.
BLAS="/usr/lib/$(uname -m)-linux-gnu/openblas-pthread/libblas.so.3"
if [ "$(uname)" = Linux ]; then
    if [ -e "$BLAS" ]; then export LD_PRELOAD="$BLAS"; else
        echo "[demo] tip: apt-get install libopenblas0-pthread makes MLX ~3x faster here" >&2
    fi
fi
exec .venv/bin/python examples/demo.py "$@"
