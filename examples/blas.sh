# Sourced by tests/run.sh, examples/demo.sh and bench/run: on Linux, preload a fast BLAS in
# front of the reference one MLX's CPU wheel links (fp32 GEMM ~100x faster here): Debian's
# OpenBLAS (apt-get install libopenblas0-pthread) where installed, else the venv's own
# (examples/ensure-venv.sh: OpenBLAS from PyPI behind examples/mlxqblas.c, where a C
# compiler was found). MLXQ_BLAS=reference keeps the reference BLAS (to measure it).
if [ "$(uname)" = Linux ] && [ "${MLXQ_BLAS:-}" != reference ]; then
    _system="/usr/lib/$(uname -m)-linux-gnu/openblas-pthread/libblas.so.3"
    if [ -e "$_system" ]; then
        export LD_PRELOAD="$_system"
    elif [ -e .venv/lib/libmlxqblas.so ]; then
        export LD_PRELOAD="$PWD/.venv/lib/libmlxqblas.so"
    else
        echo "note: MLX runs on its slow reference BLAS here (apt-get install" \
            "libopenblas0-pthread, or a C compiler for .venv's own, makes it ~10x faster)" >&2
    fi
    unset _system
fi
