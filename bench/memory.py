"""Memory: each job's peak memory (from its result metrics) against the model's weight bytes.

Jobs run through Redis and an in-process worker with a fresh cache, so the
first job on a model includes loading it. Run:

    .venv/bin/python -m bench.memory [--model PATH_OR_HUB_ID --draft ...]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from redis import Redis

from bench.fixtures import model
from bench.plots import grouped_bars
from bench.serve import burst
from producer.localredis import LocalRedis
from worker.engine.models import ModelCache, resolve_path, weight_bytes
from worker.runner import runtime

OUT = Path(__file__).parent / "out"


def run_job(
    conn: Redis, rt: runtime.WorkerRuntime, target: str, draft: str | None, max_tokens: int
) -> dict:
    body = {
        "model": target,
        "temperature": 0,
        "max_tokens": max_tokens,
        "messages": [{"role": "user", "content": "Tell me about memory."}],
    }
    if draft:
        body["draft_model"] = draft
    (record,), _ = burst(conn, [body], rt)
    m = record.metrics
    weights = weight_bytes(resolve_path(target)) + (
        weight_bytes(resolve_path(draft)) if draft else 0
    )
    return {
        "target": target,
        "draft": draft,
        "weight_gb": round(weights / 1e9, 4),
        "peak_memory_gb": round(m.peak_memory_gb, 4),
        "peak_over_weights": round(m.peak_memory_gb * 1e9 / weights, 3),
        "cache_hit": m.cache_hit,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model")
    ap.add_argument("--draft")
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args()
    cases = (
        [(args.model, args.draft)]
        if args.model
        else [(model("medium"), None), (model("wide"), None), (model("wide"), model("copy"))]
    )
    rows = []
    with LocalRedis() as server:
        conn = Redis.from_url(server.url)
        for target, draft in cases:
            rt = runtime.WorkerRuntime(cache=ModelCache(), worker_id="mem")
            rows.append(run_job(conn, rt, target, draft, args.max_tokens))
            print(rows[-1], flush=True)
    OUT.mkdir(exist_ok=True)
    (OUT / "memory.json").write_text(json.dumps(rows, indent=1))
    labels = [Path(r["target"]).name + (" + draft" if r["draft"] else "") for r in rows]
    grouped_bars(
        OUT / "memory.png",
        "Peak memory per job vs weight bytes",
        labels,
        {"weights": [r["weight_gb"] for r in rows], "peak": [r["peak_memory_gb"] for r in rows]},
        "GB",
    )


if __name__ == "__main__":
    main()
