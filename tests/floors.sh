#!/usr/bin/env bash
# Run the test suite against the lowest rq, mlx-lm and llguidance that pyproject.toml allows, in a
# scratch venv, so the declared floors are versions the suite has passed on. (The
# ceilings are what `bash tests/run.sh` installs: the newest release below them.)
#
#     bash tests/floors.sh [pytest args]        # FLOORS_VENV=/tmp/mlxq-floors by default
set -euo pipefail
cd "$(dirname "$0")/.."
floor() { sed -n "s/.*\"$1>=\([0-9.]*\)[,\"].*/\1/p" pyproject.toml | head -1; }
RQ=$(floor rq)
MLX_LM=$(floor mlx-lm)
LLG=$(floor llguidance)
[ -n "$RQ" ] && [ -n "$MLX_LM" ] && [ -n "$LLG" ] || { echo "no floors found in pyproject.toml" >&2; exit 1; }
VENV="${FLOORS_VENV:-/tmp/mlxq-floors}"
"${PYTHON:-python3}" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q -e ".[dev]" "rq==$RQ" "mlx-lm==$MLX_LM" "llguidance==$LLG"
echo "== floors: $("$VENV/bin/python" -m pip list 2>/dev/null | grep -iE '^(rq|mlx|mlx-lm|mlx-cpu|redis|transformers|llguidance) ' | tr -s ' ' | paste -sd ',' -)"
"$VENV/bin/python" -m pytest -q -p no:cacheprovider "$@"
