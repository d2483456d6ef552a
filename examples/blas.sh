# Sourced by tests/run.sh, examples/demo.sh and bench/run (from the checkout, after the venv
# exists): on Linux, preload a fast BLAS in front of the reference one MLX's CPU wheel links
# (fp32 GEMM ~30x faster here). Debian's OpenBLAS (apt-get install libopenblas0-pthread)
# where installed; else the venv's own, made once where a C compiler is found: OpenBLAS
# from PyPI (scipy-openblas32, its symbols prefixed) behind examples/mlxqblas.c, a shim
# forwarding the three GEMM calls MLX makes. MLXQ_BLAS=reference keeps the reference BLAS.
if [ "$(uname)" = Linux ] && [ "${MLXQ_BLAS:-}" != reference ]; then
    _system="/usr/lib/$(uname -m)-linux-gnu/openblas-pthread/libblas.so.3"
    _shim=.venv/lib/libmlxqblas.so
    if [ -e "$_system" ]; then
        export LD_PRELOAD="$_system"
    else
        # (a failed build leaves the reference BLAS: slow, never wrong)
        if [ ! -e "$_shim" ] && command -v cc >/dev/null 2>&1 \
            && .venv/bin/python -m pip install -q "scipy-openblas32>=0.3.27" && _lib="$(
                .venv/bin/python -c 'import scipy_openblas32 as s; print(s.get_lib_dir())')" \
            && cc -O2 -shared -fPIC -o "$_shim" examples/mlxqblas.c \
                -L"$_lib" -lscipy_openblas -Wl,-rpath,"$_lib"; then
            echo "built $_shim: OpenBLAS from PyPI for MLX" >&2
        fi
        if [ -e "$_shim" ]; then
            export LD_PRELOAD="$PWD/$_shim"
        else
            echo "note: MLX runs on its slow reference BLAS here (apt-get install" \
                "libopenblas0-pthread, or a C compiler for .venv's own, makes it ~10x faster)" >&2
        fi
    fi
    unset _system _shim _lib
fi
