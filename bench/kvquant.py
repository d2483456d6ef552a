"""Quantized KV caches: jobs held at once and tokens/s at one memory budget, 16/8/4 bits.

Side by side in one run, on one model (SmolLM2-135M-Instruct by default, the GGUF from the
package index, imported once): ``--jobs`` jobs with distinct ``--prompt-tokens``-token
prompts are served by an in-process burst worker (continuous batching, prefix cache off)
whose ``--cache-gb`` is fixed for every arm: the weights plus room for ``--room`` such
jobs' KV caches unquantized. The worker's admission decides how many jobs run at once;
it counts the quantized bytes. Per arm: the most jobs held at once, wall seconds, tokens/s
(prompt + generated, and generated), and how many jobs' greedy text equals the
unquantized arm's.

Then, per cache type, KV bytes per token at 16/8/4 bits (full-attention layers are
quantized; sliding-window layers and recurrent state are not), and the perplexity of a
held-out text through quantized caches (chunks of 64 tokens, so every chunk attends to
quantized keys) against unquantized, with greedy agreement.

    LD_PRELOAD=.../libblas.so.3 .venv/bin/python -m bench.kvquant [--jobs 16] [--prompt-tokens 2000]
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from redis import Redis

from bench.fixtures import model
from bench.serve import burst
from producer.localredis import LocalRedis
from worker.engine.kvquant import BITS, KVQuant, make_cache
from worker.engine.models import ModelCache
from worker.runner import runtime

OUT = Path(__file__).parent / "out"
ROOT = Path(__file__).resolve().parents[1]
WORDS = (
    "apple river stone queue worker model token draft target batch result metric silicon "
    "memory cache layer window state prefix budget lease shard tenant fleet record stream "
    "north south winter summer garden window bridge market letter number yellow purple"
).split()


def prompt(i: int, tokens: int) -> str:
    """A distinct text of about ``tokens`` tokens (words drawn with seed ``i``)."""
    rng = random.Random(i)
    words = " ".join(rng.choice(WORDS) for _ in range(int(tokens * 0.8)))
    return f"Document {i}. {words}\n\nWrite a long story that uses these words."


def bundled(which: str) -> str:
    from worker.gguf.bundled import GEMMA, SMOLLM2, ensure

    return str(ensure(ROOT / ".mlxq" / "models", SMOLLM2 if which == "smollm2" else GEMMA).target)


def arm(conn: Redis, target: str, bits: int | None, budget: int, bodies: list[dict]) -> dict:
    kv = KVQuant(bits) if bits else None
    rt = runtime.WorkerRuntime(
        cache=ModelCache(budget, prefix_bytes=0, kv_quant=kv), worker_id=f"kv{bits}"
    )
    records, elapsed = burst(conn, bodies, rt, max_batch=len(bodies))
    prompt_t = sum(r.response.usage.prompt_tokens for r in records)
    gen_t = sum(r.response.usage.completion_tokens for r in records)
    return {
        "kv_bits": bits or 16,
        "held_at_once": rt.stats.peak_batch,
        "seconds": round(elapsed, 2),
        "tokens_per_s": round((prompt_t + gen_t) / elapsed, 1),
        "generated_per_s": round(gen_t / elapsed, 2),
        "peak_kv_mb": round(rt.stats.peak_kv_bytes / 1e6, 1),
        "texts": [r.response.choices[0].message.content for r in records],
        "record_kv_bits": sorted({r.metrics.kv_bits or 16 for r in records}),
    }


def kv_bytes(target: str, dtype: str | None = None) -> dict:
    """KV bytes per token of each cache type unquantized and at 8/4 bits (the model cast
    to ``dtype`` first, e.g. float16 as models run on a Mac; else as it loads)."""
    from mlx.utils import tree_map

    out = {}
    for bits in (None, 8, 4):
        m, _ = ModelCache(prefix_bytes=0, kv_quant=KVQuant(bits) if bits else None).get(target)
        if dtype is not None:
            cast = getattr(mx, dtype)
            m.model.update(
                tree_map(
                    lambda a, c=cast: a.astype(c) if mx.issubdtype(a.dtype, mx.floating) else a,
                    m.model.parameters(),
                )
            )
        out[bits or "unquantized"] = {
            "full_attention": m.kv.per_token,
            "sliding_window": [per for _, per in m.kv.windows],
            "recurrent_fixed": m.kv.fixed,
            "quantized": m.kv_bits is not None,
        }
    return out


def held_out(tok, n: int) -> list[int]:
    """``n`` tokens of English prose from Python's own documentation (the same text on
    every machine with this Python)."""
    import argparse as a
    import collections
    import json as j
    import textwrap

    text = "\n".join(m.__doc__ or "" for m in (a, collections, j, textwrap))
    return tok.encode(text)[:n]


def perplexity(net, tok, tokens: int = 512, chunk: int = 64) -> dict:
    """Perplexity of a held-out text through 16/8/4-bit caches, fed ``chunk`` tokens at a
    time (so each chunk attends to the earlier ones' quantized keys), and each arm's
    greedy agreement with the unquantized one."""
    ids = held_out(tok, tokens)
    out, ref = {}, None
    for bits in (None, 8, 4):
        cache = make_cache(net, KVQuant(bits) if bits else None)
        parts = [
            net(mx.array([ids[i : i + chunk]]), cache=cache)[0] for i in range(0, len(ids), chunk)
        ]
        logits = mx.concatenate(parts).astype(mx.float32)
        logp = logits[:-1] - mx.logsumexp(logits[:-1], axis=-1, keepdims=True)
        nll = -mx.take_along_axis(logp, mx.array(ids[1:])[:, None], axis=-1).mean()
        ppl = math.exp(nll.item())  # (in MLX: numpy's softmax over 262k columns took seconds)
        greedy = np.array(mx.argmax(logits, axis=-1))
        ref = greedy if ref is None else ref
        out[bits or 16] = {
            "perplexity": round(ppl, 3),
            "greedy_agreement": round(float(np.mean(greedy == ref)), 4),
        }
    for row in out.values():
        row["vs_16"] = round(row["perplexity"] / out[16]["perplexity"], 4)
    return out


def _timed(f: Any) -> float:
    """Median milliseconds of ``f()`` evaluated, over 30 runs after one."""
    mx.eval(f())
    times = []
    for _ in range(30):
        t = time.perf_counter()
        mx.eval(f())
        times.append(time.perf_counter() - t)
    return round(statistics.median(times) * 1e3, 3)


def _attention_row(rows: int, n: int, bits: int) -> dict[str, float]:
    from mlx_lm.models.base import quantized_scaled_dot_product_attention as quantized_sdpa

    g = KVQuant(bits).group_size
    q = mx.random.normal((rows, 9, 1, 64))
    k, v = mx.random.normal((rows, 3, n, 64)), mx.random.normal((rows, 3, n, 64))
    qk, qv = (mx.quantize(x, group_size=g, bits=bits) for x in (k, v))
    mx.eval(q, k, v, *qk, *qv)

    def dequantized() -> mx.array:
        kk, vv = (mx.dequantize(*t, group_size=g, bits=bits) for t in (qk, qv))
        return mx.fast.scaled_dot_product_attention(q, kk, vv, scale=0.125)

    return {
        "float": _timed(lambda: mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125)),
        "quantized": _timed(
            lambda: quantized_sdpa(q, qk, qv, scale=0.125, mask=None, group_size=g, bits=bits)
        ),
        "dequantized first": _timed(dequantized),
    }


def attention(rows: int = 9, contexts: tuple[int, ...] = (500, 1000, 2000)) -> dict:
    """Milliseconds of one decoding step's attention per layer (one query per row;
    SmolLM2's 9 query and 3 KV heads of 64), medians of 30: float keys and values,
    quantized (mlx-lm's ``quantized_matmul`` path, which decoding takes), and dequantized
    first then the fused attention. On MLX's CPU backend the quantized kernels are the
    slow part."""
    out: dict = {}
    for bits in BITS[::-1]:
        for n in contexts:
            row = _attention_row(rows, n, bits)
            out[f"{bits} bits, {n} tokens"] = row
            print(f"attention, {rows} rows, {bits} bits, {n} tokens (ms a layer): {row}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default=None, help="a model path [the bundled SmolLM2-135M]")
    ap.add_argument("--jobs", type=int, default=16)
    ap.add_argument("--prompt-tokens", type=int, default=2000)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--room", type=int, default=4, help="jobs the budget holds unquantized")
    ap.add_argument("--skip-arms", action="store_true", help="only the bytes and perplexity")
    ap.add_argument("--attention", action="store_true", help="only decoding attention's cost")
    args = ap.parse_args()
    if args.attention:
        OUT.mkdir(exist_ok=True)
        (OUT / "kvquant-attention.json").write_text(json.dumps(attention(), indent=1))
        return
    target = args.target or bundled("smollm2")
    bodies = [
        {
            "model": target,
            "temperature": 0,
            "max_tokens": args.max_tokens,
            "messages": [{"role": "user", "content": prompt(i, args.prompt_tokens)}],
        }
        for i in range(args.jobs)
    ]
    report: dict = {"target": target, "jobs": args.jobs}
    if not args.skip_arms:
        probe, _ = ModelCache(prefix_bytes=0).get(target)
        per_job = probe.kv.bytes_for(args.prompt_tokens + args.max_tokens + 64)
        budget = probe.nbytes + args.room * per_job + per_job // 2
        report["cache_gb"] = round(budget / 1e9, 3)
        print(
            f"--cache-gb {budget / 1e9:.3f}: weights {probe.nbytes / 1e6:.0f} MB + room", flush=True
        )
        rows = []
        with LocalRedis() as server:
            conn = Redis.from_url(server.url)
            for bits in (None, 8, 4):
                rows.append(arm(conn, target, bits, budget, bodies))
                r = rows[-1]
                same = sum(a == b for a, b in zip(r["texts"], rows[0]["texts"], strict=True))
                r["same_text_as_16"] = same
                print(
                    f"KV {r['kv_bits']:>2} bits: {r['held_at_once']:>2} jobs at once, "
                    f"{r['seconds']:6.1f} s, {r['tokens_per_s']:7.1f} tok/s "
                    f"({r['generated_per_s']} generated/s), same text as 16-bit: "
                    f"{same}/{len(bodies)}, records say {r['record_kv_bits']}",
                    flush=True,
                )
        base = rows[0]
        for r in rows:
            r["held_vs_16"] = round(r["held_at_once"] / base["held_at_once"], 2)
            r["throughput_vs_16"] = round(r["tokens_per_s"] / base["tokens_per_s"], 3)
            del r["texts"]
        print(
            "ratios vs 16-bit:",
            [(r["kv_bits"], r["held_vs_16"], r["throughput_vs_16"]) for r in rows],
        )
        report["arms"] = rows
    report["kv_bytes_per_token"] = {}
    for name, path in (
        ("smollm2 (llama: full attention)", target),
        ("gemma 3 270M (5 sliding : 1 global)", bundled("gemma")),
        ("qwen3.5-shaped (recurrent + full)", model("wide-qwen35")),
    ):
        for dtype in (None, "float16"):
            label = f"{name}, {dtype or 'as loaded'}"
            report["kv_bytes_per_token"][label] = kv_bytes(path, dtype)
            print(label, json.dumps(report["kv_bytes_per_token"][label]), flush=True)
    report["perplexity"] = {}
    for name, path in (("smollm2", target), ("gemma3-270m", bundled("gemma"))):
        from mlx_lm import load

        report["perplexity"][name] = perplexity(*load(path))
        print("perplexity", name, json.dumps(report["perplexity"][name]), flush=True)
    OUT.mkdir(exist_ok=True)
    (OUT / "kvquant.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
