"""Benchmark models, built deterministically once and cached outside git.

Cache folder: $MLXQ_BENCH_CACHE, else ~/.cache/mlxq-bench. Benchmarks accept
``--target`` / ``--draft`` hub ids or paths instead (e.g. on a Mac).

All synthetic: random weights, one shared BPE tokenizer (vocab 512) but for ``wide32k``.
- ``wide``: llama 12 x 1024 (intermediate 2816, 16 heads), fp32, ~150M params.
  Its greedy output falls into long repeats (mlx's default init).
- ``copy``: 1 x 128, tied embeddings, attention and MLP outputs zeroed: it
  predicts the last token again, so it agrees with ``wide`` often by construction.
- ``unrelated``: 1 x 128 random: the same tokenizer, ~0% acceptance.
- ``medium``: 8 x 512, for the quicker worker-overhead benchmark.
- ``quote32k``: ``wide32k``'s size, one attention head, built to quote: its greedy
  answer replays the end of its prompt (``TinySpec.quote``), as extraction jobs do;
  ``free32k``: ``wide32k`` scaled up, so its text varies and copies nothing.
- ``wide-gemma3``: ``wide``'s size in Gemma 3's shape (``gemma3_text``: 5 sliding-window
  layers of window 512 to 1 global, head_dim 64); ``wide-qwen35``: in Qwen3.5's
  (``qwen3_5``: 3 gated delta-net linear-attention layers to 1 full attention). Both
  repeat their last token as ``wide`` does (``TinySpec.repeats``), so ``copy`` agrees.
"""

from __future__ import annotations

import os
import sys
from dataclasses import replace
from pathlib import Path

from worker.dev.tinymodels import TinySpec, ensure_model

#: The 12 x 1024 target most benchmarks use, and its 32,000-entry byte-level BPE twin.
WIDE = TinySpec(
    layers=12,
    hidden=1024,
    intermediate=2816,
    heads=16,
    kv_heads=16,
    context=4096,
    seed=101,
    tied=False,
    weight_scale=1.0,
)
WIDE32K = replace(WIDE, vocab=32000, tokenizer="bpe32k")

SPECS: dict[str, TinySpec] = {
    "wide": WIDE,
    # ``wide`` with a 32,000-entry byte-level BPE (structured output's benchmark).
    "wide32k": WIDE32K,
    "copy": TinySpec(
        layers=1,
        hidden=128,
        intermediate=256,
        heads=4,
        kv_heads=4,
        context=4096,
        seed=102,
        weight_scale=1.0,
        copy_last_token=True,
    ),
    "unrelated": TinySpec(
        layers=1, hidden=128, intermediate=256, heads=4, kv_heads=4, context=4096, seed=103
    ),
    "wide-gemma3": replace(
        WIDE,
        arch="gemma3_text",
        window=512,
        kv_heads=8,
        context=8192,
        seed=104,
        tied=True,
        repeats=True,
    ),
    "wide-qwen35": replace(
        WIDE,
        arch="qwen3_5",
        kv_heads=8,
        context=8192,
        seed=105,
        tied=True,
        weight_scale=0.5,
        repeats=True,
    ),
    # ``wide32k``'s size and tokenizer, built to quote (``TinySpec.quote``): its greedy
    # answer replays the last 96 tokens of its prompt (prompt lookup's copy-heavy work).
    "quote32k": replace(WIDE32K, heads=1, kv_heads=1, seed=106, tied=True, quote=96),
    # ``wide32k`` with projections scaled 2.5x: its greedy text varies with context and
    # repeats nothing (prompt lookup's free-text workload: nothing to copy).
    "free32k": replace(WIDE32K, seed=107, weight_scale=2.5),
    "medium": TinySpec(
        layers=8, hidden=512, intermediate=1408, heads=8, kv_heads=8, context=4096, seed=11
    ),
    "medium-draft": TinySpec(
        layers=1, hidden=128, intermediate=256, heads=4, kv_heads=4, context=4096, seed=12
    ),
}


def cache_dir() -> Path:
    return Path(os.environ.get("MLXQ_BENCH_CACHE", Path.home() / ".cache" / "mlxq-bench"))


def model(name: str) -> str:
    """Path of the named synthetic model, built on first use."""
    return str(ensure_model(cache_dir() / name, SPECS[name]))


def bench_pair() -> tuple[str, str]:
    """The medium target and an unrelated small draft (worker-overhead benchmark)."""
    return model("medium"), model("medium-draft")


if __name__ == "__main__":
    for name in sys.argv[1:] or SPECS:
        print(name, model(name))
