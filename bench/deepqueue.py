"""Batch or speculate: a deep queue of draft jobs through a real worker, three ways.

N greedy jobs naming a draft wait in the queue at once; an in-process mlxq
worker (real Redis, the real lifecycle, real result records) serves them:

- speculate one at a time: ``--max-batch 1``, ``--speculative auto`` (its
  policy warmed by a first pass, so it runs its best draft length);
  (a batched pass warms MLX's buffers for batches before anything is timed)
- batch without the draft: ``--max-batch 8``, ``--speculative never``;
- speculative batches: ``--max-batch 8``, ``--speculative always`` at each k of
  ``--ks`` (the draft proposes k tokens for every sequence of the batch, the
  target verifies them all in one pass: ``worker.specbatch``);
- auto: ``--max-batch 8``, ``--speculative auto``, from a fresh policy (cold:
  it first measures the pair one job at a time, then a batch) and again with
  what it measured (warm).

Throughput is completion tokens over wall time from submit to the last
result. Synthetic models (bench/fixtures.py).

    .venv/bin/python -m bench.deepqueue [--jobs 16] [--max-tokens 32]
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path

from redis import Redis

from bench.fixtures import model
from bench.plots import grouped_bars
from bench.serve import burst
from producer.localredis import LocalRedis
from worker import runtime
from worker.cache import ModelCache
from worker.policy import SpeculationPolicy

OUT = Path(__file__).parent / "out"


def bodies(target: str, draft: str, n: int, max_tokens: int) -> list[dict]:
    return [
        {
            "model": target,
            "draft_model": draft,
            "temperature": 0,
            "max_tokens": max_tokens,
            "messages": [{"role": "user", "content": f"Job {i}: tell me about queues."}],
        }
        for i in range(n)
    ]


def serve(url: str, jobs: list[dict], rt: runtime.WorkerRuntime, max_batch: int) -> dict:
    """Submit ``jobs`` at once, serve them with one worker; throughput and what ran."""
    records, elapsed = burst(Redis.from_url(url), jobs, rt, max_batch)
    tokens = sum(r.response.usage.completion_tokens for r in records if r.response)
    ran = Counter(  # a batch's last job finishes alone (batch_size 1): the reason tells
        "batched"
        if r.metrics.batch_size > 1 or "batch" in (r.metrics.speculation_reason or "")
        else f"alone k={r.metrics.num_draft_tokens or 0}"
        for r in records
    )
    texts = [r.response.choices[0].message.content for r in records if r.response]
    return {"tok_s": tokens / elapsed, "seconds": elapsed, "ran": dict(ran), "texts": texts}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--max-batch", type=int, default=8)
    ap.add_argument("--ks", default="1,2,3,4,6", help="draft lengths of the speculative batches")
    ap.add_argument("--pairs", default="copy,unrelated")
    args = ap.parse_args()
    ks = [int(k) for k in args.ks.split(",") if k]
    target = model("wide")
    cache = ModelCache()
    report: dict = {"target": target, "jobs": args.jobs, "max_tokens": args.max_tokens}
    rows: dict[str, dict] = {}
    with LocalRedis() as server:
        for name, draft in ((f"{p} (synthetic)", model(p)) for p in args.pairs.split(",") if p):
            jobs = bodies(target, draft, args.jobs, args.max_tokens)

            def rt(policy: SpeculationPolicy) -> runtime.WorkerRuntime:
                return runtime.WorkerRuntime(cache=cache, worker_id="deep", policy=policy)

            alone_policy = SpeculationPolicy("auto")
            serve(server.url, jobs, rt(alone_policy), 1)  # warm the models and the policy
            serve(server.url, jobs, rt(SpeculationPolicy("never")), args.max_batch)  # and batches
            alone = serve(server.url, jobs, rt(alone_policy), 1)
            batched = serve(server.url, jobs, rt(SpeculationPolicy("never")), args.max_batch)
            spec = {
                k: serve(
                    server.url, jobs, rt(SpeculationPolicy("always", default_k=k)), args.max_batch
                )
                for k in ks
            }
            auto_policy = SpeculationPolicy("auto")
            cold = serve(server.url, jobs, rt(auto_policy), args.max_batch)
            warm = serve(server.url, jobs, rt(auto_policy), args.max_batch)
            best_k = max(spec, key=lambda k: spec[k]["tok_s"]) if spec else None
            best_before = max(alone["tok_s"], batched["tok_s"])
            best = max(best_before, *(v["tok_s"] for v in spec.values()))
            row = {
                "tok_s": {
                    "speculate one at a time": round(alone["tok_s"], 2),
                    "batch without draft": round(batched["tok_s"], 2),
                    **{f"spec batch k={k}": round(v["tok_s"], 2) for k, v in spec.items()},
                    "auto cold": round(cold["tok_s"], 2),
                    "auto warm": round(warm["tok_s"], 2),
                },
                "spec_batch_best_k": best_k,
                "spec_batch_over_better_of_batch_and_alone": round(
                    spec[best_k]["tok_s"] / best_before, 3
                )
                if best_k
                else None,
                "ran": {"alone": alone["ran"], "auto cold": cold["ran"], "auto warm": warm["ran"]},
                "auto_warm_over_best": round(warm["tok_s"] / best, 3),
                "auto_cold_over_best": round(cold["tok_s"] / best, 3),
                "greedy_outputs_equal": alone["texts"] == batched["texts"] == warm["texts"]
                and all(v["texts"] == alone["texts"] for v in spec.values()),
                "batch_speeds_measured": {
                    str(k): {str(n): round(a.value, 1) for n, a in v.by_size.items()}
                    for k, v in (auto_policy.batches | auto_policy.spec_batches).items()
                },
            }
            rows[name] = row
            print(name, json.dumps(row), flush=True)
    report["pairs"] = rows
    OUT.mkdir(exist_ok=True)
    (OUT / "deepqueue.json").write_text(json.dumps(report, indent=1))
    names = list(rows)
    grouped_bars(
        OUT / "deepqueue.png",
        f"{args.jobs} queued draft jobs: batch or speculate",
        names,
        {k: [rows[n]["tok_s"][k] for n in names] for k in rows[names[0]]["tok_s"]},
        "tokens/s",
    )


if __name__ == "__main__":
    main()
