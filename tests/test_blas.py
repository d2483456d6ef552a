"""examples/mlxqblas.c: MLX's three GEMM calls forwarded to OpenBLAS from PyPI (the venv's
fast BLAS where Debian's is not installed, ``examples/blas.sh``). Built here and preloaded
into a fresh process, each call's result is numpy's (the suite itself runs on it on a
machine without Debian's OpenBLAS)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.waiting import seconds

ROOT = Path(__file__).resolve().parents[1]

CHECK = """
import mlx.core as mx, numpy as np
rng = np.random.default_rng(0)
kinds = ((np.float32, mx.float32, 1e-4), (np.float64, mx.float64, 1e-10),
         (np.complex64, mx.complex64, 1e-4))
for dtype, kind, tol in kinds:
    a = rng.normal(size=(67, 129)).astype(dtype)
    b = rng.normal(size=(129, 33)).astype(dtype)
    if dtype == np.complex64:
        a = a + 1j * rng.normal(size=a.shape).astype(np.float32)
        b = b - 2j * rng.normal(size=b.shape).astype(np.float32)
    for x, y in ((a, b), (a[:40].T.copy().T, b)):  # (and a transposed operand)
        want = x.astype(np.complex128 if dtype == np.complex64 else np.float64) @ y
        got = mx.matmul(mx.array(x, dtype=kind), mx.array(y, dtype=kind), stream=mx.cpu)
        assert got.dtype == kind
        got = np.array(got)
        err = np.abs(got - want).max() / np.abs(want).max()
        assert err < tol, (dtype, err)
print("ok")
"""


def test_the_shim_forwards_every_gemm_mlx_calls(tmp_path):
    if sys.platform != "linux":
        pytest.skip("Linux only: macOS MLX uses Accelerate")
    cc = shutil.which("cc")
    try:
        import scipy_openblas32
    except ImportError:
        scipy_openblas32 = None
    if cc is None or scipy_openblas32 is None:
        pytest.skip("no C compiler or no scipy-openblas32 (examples/blas.sh installs it)")
    lib = scipy_openblas32.get_lib_dir()
    shim = tmp_path / "libmlxqblas.so"
    build = [cc, "-O2", "-shared", "-fPIC", "-o", str(shim), str(ROOT / "examples/mlxqblas.c")]
    build += [f"-L{lib}", "-lscipy_openblas", f"-Wl,-rpath,{lib}"]
    subprocess.run(build, check=True, timeout=seconds(60))
    symbols = subprocess.run(["nm", "-D", str(shim)], capture_output=True, text=True).stdout
    assert all(f" T cblas_{t}gemm" in symbols for t in "sdc"), symbols
    env = os.environ | {"LD_PRELOAD": str(shim), "OPENBLAS_NUM_THREADS": "1"}
    run = subprocess.run(
        [sys.executable, "-c", CHECK], env=env, capture_output=True, text=True, timeout=seconds(120)
    )
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr
