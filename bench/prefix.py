"""Prefix cache: many jobs sharing one long system prompt, three ways, side by side.

64 greedy jobs on the 8x512 model share a ~1,500-token system prompt, each with
its own ~20-token user message and ``max_tokens`` 8 (prefill is most of the work):

- mlxq with its prefix cache (the default), one in-process worker (batches of 8);
- mlxq with ``--prefix-cache-gb 0``, the same worker otherwise;
- ``mlx_lm.server`` (same mlx-lm, same model, its prompt cache on by default), the
  64 requests sent at once from 64 threads.

Every arm starts with the model loaded and warmed by one unrelated request.
Reports jobs/s, the ratios, peak memory of the mlxq arms, the cache's bytes vs
its budget, and whether outputs match.

    .venv/bin/python -m bench.prefix [--jobs 64] [--system-tokens 1500] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import mlx.core as mx
from redis import Redis

from bench.fixtures import model
from bench.peer import mlx_lm_server, send_all
from bench.plots import grouped_bars
from bench.serve import burst
from producer.localredis import LocalRedis
from worker.engine.models import ModelCache
from worker.runner import runtime

OUT = Path(__file__).parent / "out"
LABELS = {
    "cache": "mlxq (prefix cache)",
    "no cache": "mlxq --prefix-cache-gb 0",
    "mlx_lm.server": "mlx_lm.server",
}
WORDS = "queue worker lease batch prefix token model draft cache result record fleet".split()


def system_prompt(tokenizer, n_tokens: int) -> str:
    """A rubric-like system prompt of about ``n_tokens`` tokens."""
    parts, i = [], 0
    while len(tokenizer.encode(" ".join(parts))) < n_tokens:
        parts.append(f"Rule {i}: grade the {WORDS[i % len(WORDS)]} line, then say why.")
        i += 1
    return " ".join(parts)


def bodies(target: str, system: str, n: int, max_tokens: int) -> list[dict]:
    return [
        {
            "model": target,
            "temperature": 0,
            "max_tokens": max_tokens,
            "messages": [
                {"role": "system", "content": system},
                {"role": "user", "content": f"Item {i}: the {WORDS[i % 12]} of job {i * 7}."},
            ],
        }
        for i in range(n)
    ]


def through_worker(conn: Redis, target: str, reqs: list[dict], prefix_gb: float) -> dict:
    cache = ModelCache(prefix_bytes=int(prefix_gb * 1e9))
    cache.get(target)
    rt = runtime.WorkerRuntime(cache=cache, worker_id=f"bench-prefix-{prefix_gb}")
    warm = [{"model": target, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}]
    burst(conn, warm, rt, 8)
    mx.reset_peak_memory()
    records, elapsed = burst(conn, reqs, rt, 8)
    return {
        "jobs_per_s": len(records) / elapsed,
        "texts": [r.response.choices[0].message.content for r in records],
        "cached_tokens": [r.response.usage.prompt_tokens_details.cached_tokens for r in records],
        "prompt_tokens": records[0].response.usage.prompt_tokens,
        "peak_memory_mb": mx.get_peak_memory() / 1e6,
        "prefix_cache_mb": cache.prefixes.nbytes / 1e6,
        "prefix_budget_mb": cache.prefixes.budget_bytes / 1e6,
        "weights_mb": cache.model_bytes / 1e6,
    }


def through_server(target: str, reqs: list[dict]) -> dict:
    """mlx_lm.server with its defaults; all requests at once."""
    with mlx_lm_server(target) as port:
        replies, elapsed = send_all(port, reqs)
    return {
        "jobs_per_s": len(replies) / elapsed,
        "texts": [r["choices"][0]["message"]["content"] for r in replies],
        "cached_tokens": [
            (r.get("usage", {}).get("prompt_tokens_details") or {}).get("cached_tokens")
            for r in replies
        ],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default=None, help="model path or hub id [default: 8x512]")
    ap.add_argument("--jobs", type=int, default=64)
    ap.add_argument("--system-tokens", type=int, default=1500)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    target = args.target or model("medium")
    tokenizer = ModelCache().get(target)[0].tokenizer
    reqs = bodies(target, system_prompt(tokenizer, args.system_tokens), args.jobs, args.max_tokens)
    runs: dict[str, list[dict]] = {"cache": [], "no cache": [], "mlx_lm.server": []}
    with LocalRedis() as server:
        conn = Redis.from_url(server.url)
        for _ in range(args.rounds):
            for name, arm in (
                ("no cache", lambda: through_worker(conn, target, reqs, 0)),
                ("cache", lambda: through_worker(conn, target, reqs, 1.0)),
                ("mlx_lm.server", lambda: through_server(target, reqs)),
            ):
                runs[name].append(arm())
                print(f"{name}: {runs[name][-1]['jobs_per_s']:.2f} jobs/s", file=sys.stderr)
    speed = {k: statistics.median(r["jobs_per_s"] for r in v) for k, v in runs.items()}
    on, off, srv = runs["cache"][-1], runs["no cache"][-1], runs["mlx_lm.server"][-1]
    report = {
        "target": target,
        "jobs": args.jobs,
        "prompt_tokens": on["prompt_tokens"],
        "shared_prefix_tokens": max(on["cached_tokens"]),
        "max_tokens": args.max_tokens,
        "rounds": args.rounds,
        "jobs_per_s": {k: round(v, 2) for k, v in speed.items()},
        "jobs_per_s_per_round": {
            k: [round(r["jobs_per_s"], 2) for r in v] for k, v in runs.items()
        },
        "cache_over_no_cache": round(speed["cache"] / speed["no cache"], 2),
        "cache_over_mlx_lm_server": round(speed["cache"] / speed["mlx_lm.server"], 2),
        "jobs_reusing_the_prefix": sum(1 for c in on["cached_tokens"] if c),
        "peak_memory_mb": {
            "cache": round(on["peak_memory_mb"]),
            "no cache": round(off["peak_memory_mb"]),
        },
        "weights_mb": round(on["weights_mb"]),
        "prefix_cache_mb": round(on["prefix_cache_mb"], 1),
        "prefix_budget_mb": round(on["prefix_budget_mb"]),
        "outputs_equal_cache_vs_no_cache": on["texts"] == off["texts"],
        "server_outputs_equal_to_mlxq": sum(
            a == b for a, b in zip(srv["texts"], on["texts"], strict=True)
        ),
        "server_cached_tokens_reported": sum(1 for c in srv["cached_tokens"] if c),
    }
    OUT.mkdir(exist_ok=True)
    (OUT / "prefix.json").write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))
    grouped_bars(
        OUT / "prefix.png",
        f"{args.jobs} jobs sharing a {report['shared_prefix_tokens']}-token system prompt",
        ["jobs/s"],
        {LABELS[k]: [v] for k, v in speed.items()},
        ylabel="jobs/s",
    )


if __name__ == "__main__":
    main()
