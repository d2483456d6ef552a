"""Continuous batching: 8 queued jobs on one model, through the worker batched vs one at a time,
side by side with mlx-lm's own ``batch_generate`` on the same prompts.

    .venv/bin/python -m bench.batching [--target PATH_OR_HUB_ID] [--jobs 8] [--max-tokens 128]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm.generate import batch_generate
from redis import Redis

from bench.fixtures import model
from bench.plots import grouped_bars
from bench.serve import burst
from producer.localredis import LocalRedis
from schemas import ChatRequest
from worker.engine import prompt_tokens
from worker.engine.models import ModelCache
from worker.runner import runtime

OUT = Path(__file__).parent / "out"


def bodies(target: str, n: int, max_tokens: int) -> list[dict]:
    return [
        {
            "model": target,
            "temperature": 0,
            "max_tokens": max_tokens,
            "messages": [{"role": "user", "content": f"Question {i}: what is a job queue?"}],
        }
        for i in range(n)
    ]


def through_worker(conn: Redis, cache: ModelCache, reqs: list[dict], max_batch: int) -> tuple:
    rt = runtime.WorkerRuntime(cache=cache, worker_id=f"bench-{max_batch}")
    records, elapsed = burst(conn, reqs, rt, max_batch)
    tokens = sum(r.response.usage.completion_tokens for r in records if r.response)
    return tokens / elapsed, [r.response.choices[0].message.content for r in records]


def direct_batch(cache: ModelCache, reqs: list[dict]) -> tuple:
    entry, _ = cache.get(reqs[0]["model"])
    prompts = [prompt_tokens(entry.tokenizer, ChatRequest.model_validate(b)) for b in reqs]
    start = time.perf_counter()
    out = batch_generate(
        entry.model,
        entry.tokenizer,
        prompts,
        max_tokens=reqs[0]["max_tokens"],
        return_token_ids=True,
    )
    mx.synchronize()
    elapsed = time.perf_counter() - start
    tokens = sum(len(t) + (len(t) < reqs[0]["max_tokens"]) for t in out.token_ids)
    return tokens / elapsed, out.texts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target")
    ap.add_argument("--jobs", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    target = args.target or model("medium")
    reqs = bodies(target, args.jobs, args.max_tokens)
    cache = ModelCache()
    cache.get(target)
    rates: dict[str, list[float]] = {"sequential": [], "batched": [], "batch_generate": []}
    same = []
    with LocalRedis() as server:
        conn = Redis.from_url(server.url)
        direct_batch(cache, reqs[:2])  # warm up
        for _ in range(args.rounds):
            conn.flushall()
            r_seq, texts_seq = through_worker(conn, cache, reqs, 1)
            r_bat, texts_bat = through_worker(conn, cache, reqs, args.jobs)
            r_dir, _ = direct_batch(cache, reqs)
            rates["sequential"].append(r_seq)
            rates["batched"].append(r_bat)
            rates["batch_generate"].append(r_dir)
            same.append(sum(a == b for a, b in zip(texts_seq, texts_bat, strict=True)))
    med = {k: statistics.median(v) for k, v in rates.items()}
    report = {
        "target": target,
        "synthetic": args.target is None,
        "jobs": args.jobs,
        "max_tokens": args.max_tokens,
        "tok_s": {k: round(v, 1) for k, v in med.items()},
        "batched_over_sequential": round(med["batched"] / med["sequential"], 2),
        "batched_over_mlx_lm_batch_generate": round(med["batched"] / med["batch_generate"], 3),
        "jobs_with_output_equal_to_sequential": min(same),
    }
    OUT.mkdir(exist_ok=True)
    (OUT / "batching.json").write_text(json.dumps(report, indent=1))
    grouped_bars(
        OUT / "batching.png",
        f"{args.jobs} queued jobs, one model, no draft",
        ["tokens/s"],
        {k: [v] for k, v in med.items()},
        "tokens/s (median)",
    )
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
