"""Benchmark models, built deterministically once and cached outside git.

Cache folder: $MLXQ_BENCH_CACHE, else ~/.cache/mlxq-bench. ``--target`` and
``--draft`` on each benchmark accept hub ids or paths instead (e.g. on a Mac).
"""

from __future__ import annotations

import os
from pathlib import Path

from worker.tinymodels import TinySpec, ensure_model

TARGET = TinySpec(
    layers=8, hidden=512, intermediate=1408, heads=8, kv_heads=8, context=4096, seed=11
)
DRAFT = TinySpec(layers=1, hidden=128, intermediate=256, heads=4, kv_heads=4, context=4096, seed=12)


def cache_dir() -> Path:
    return Path(os.environ.get("MLXQ_BENCH_CACHE", Path.home() / ".cache" / "mlxq-bench"))


def bench_pair() -> tuple[str, str]:
    """A synthetic random target (~25M params) and an unrelated small draft, same tokenizer."""
    root = cache_dir()
    return str(ensure_model(root / "target-8x512", TARGET)), str(
        ensure_model(root / "draft-1x128", DRAFT)
    )
