#!/usr/bin/env bash
# The real model's figures (Gemma 3 270M from the package index: float32 target, its
# 4-bit copy as draft), each from an existing benchmark pointed at it; JSON in bench/out/.
#   bash bench/real.sh [worker speculative structured logprobs prefix peer restarts]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
BLAS="/usr/lib/$(uname -m)-linux-gnu/openblas-pthread/libblas.so.3"
if [ "$(uname)" = Linux ] && [ -e "$BLAS" ]; then export LD_PRELOAD="$BLAS"; fi
"$PY" -c "from pathlib import Path; from worker.gguf.bundled import ensure; ensure(Path('.mlxq/models'))"
T=.mlxq/models/gemma-3-270m
D=.mlxq/models/gemma-3-270m-q4
PARTS="${*:-worker speculative structured logprobs prefix peer}"
for part in $PARTS; do
    echo "== $part (LD_PRELOAD=${LD_PRELOAD:-none})"
    case "$part" in
        worker) "$PY" -m bench.worker --target "$T" --draft "$D" --rounds 1 --max-tokens 32 --halves plain ;;
        speculative) "$PY" -m bench.speculative --target "$T" --draft "q4=$D" --ks 1-4 --max-tokens 48 --reps 1 ;;
        structured) "$PY" -m bench.structured --target "$T" --rounds 2 --tokens 32 --parts cost ;;
        logprobs) "$PY" -m bench.logprobs --target "$T" --jobs 6 --max-tokens 32 ;;
        prefix) "$PY" -m bench.prefix --target "$T" --jobs 16 --rounds 1 ;;
        restarts) "$PY" -m bench.restarts --target "$T" --draft "$D" --ks 1,2 --jobs 8 --max-tokens 32 --rounds 1 ;;
        peer) "$PY" -m bench.batchsize --target "$T" --jobs 32 --fixed 8 --rounds 1 --parts throughput ;;
        *) echo "unknown part $part" >&2; exit 2 ;;
    esac
done
