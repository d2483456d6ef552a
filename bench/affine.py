"""A queue alternating two models on a worker with room for one: model-affine takes vs in order.

24 greedy jobs of 16 tokens alternating SmolLM2-135M-Instruct and Gemma 3 270M (both
from the package index, float32: 0.5 and 1.1 GB), submitted at once, one in-process
burst worker (``--max-batch auto``), submit to last record. Arms, in one run, each on
a fresh model cache:

- room for both: no budget (the reference: 2 loads);
- room for one, in order (before: ``--model-wait 0``): the queue taken strictly in turn;
- room for one, model-affine (now: ``--model-wait 30``, the default);
- room for both, both loaded before the jobs come (a warm worker: the second model's
  jobs run in a side lane beside the first model's batch, issue 69 step 8).

Prints seconds, model loads, the ratio to *room for both* and, per model, the seconds
from submit to its first and last record; every arm's texts equal.
Goal: room for one, model-affine <= 1.3x room for both.

    .venv/bin/python -m bench.affine [--jobs 24] [--tokens 16] [--rounds 1]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from redis import Redis

from producer import Client
from producer.localredis import LocalRedis
from schemas.store import read_result
from worker.engine.models import ModelCache, weight_bytes
from worker.gguf.bundled import ensure
from worker.runner.loop import Worker
from worker.runner.runtime import WorkerRuntime

OUT = Path(__file__).parent / "out"
MODELS = Path(".mlxq/models")


def arm(
    url: str, models: list[str], jobs: int, tokens: int, budget: int | None, wait: float, warm: bool
):
    """(seconds, loads, texts, each model's (first, last) record in s from submit)."""
    conn = Redis.from_url(url)
    conn.flushdb()
    body = {
        f"j{i}": {
            "model": models[i % 2],
            "messages": [{"role": "user", "content": f"Name a fruit. ({i})"}],
            "max_tokens": tokens,
            "temperature": 0,
        }
        for i in range(jobs)
    }
    rt = WorkerRuntime(cache=ModelCache(budget_bytes=budget), worker_id="bench-affine")
    for m in models if warm else ():
        rt.cache.get(m)
    loaded, submitted = rt.cache.loads, time.time()
    started = time.perf_counter()
    s = Client(connection=conn).submit(body, batch_id="mixed")
    Worker(conn, ["mlxq"], rt, name="bench", max_batch=None, burst=True, model_wait_s=wait).work()
    took = time.perf_counter() - started
    records = [read_result(conn, j) for j in s.job_ids]
    assert all(r is not None and r.status == "succeeded" for r in records), records
    ends = [[r.finished_at - submitted for r in records[m::2]] for m in range(2)]
    spans = [(min(e), max(e)) for e in ends]
    texts = [r.response.choices[0].message.content for r in records]
    return took, rt.cache.loads - loaded, texts, spans


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=24)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=1)
    args = ap.parse_args()
    ensure(MODELS)
    models = [str(MODELS / "smollm2-135m-instruct"), str(MODELS / "gemma-3-270m")]
    sizes = [weight_bytes(Path(m)) for m in models]
    one = int(max(sizes) * 1.25)  # the larger model and its jobs' KV caches, not both
    arms = {
        "room for both": (None, 30.0, False),
        "room for one, in order (before)": (one, 0.0, False),
        "room for one, model-affine (now)": (one, 30.0, False),
        "room for both, loaded before": (None, 30.0, True),
    }
    runs: list[dict] = []
    with LocalRedis() as r:
        for n in range(args.rounds):
            texts = None
            for name, (budget, wait, warm) in arms.items():
                took, loads, got, spans = arm(
                    r.url, models, args.jobs, args.tokens, budget, wait, warm
                )
                assert texts is None or got == texts, f"{name}: texts differ"
                texts = got
                runs.append({"round": n, "arm": name, "s": took, "loads": loads, "spans": spans})
    print(
        f"models {[Path(m).name for m in models]}, {sizes[0] / 1e9:.2f} + {sizes[1] / 1e9:.2f} GB"
    )
    print(f"budget for one: {one / 1e9:.2f} GB; {args.jobs} jobs of {args.tokens} tokens")
    for row in runs:
        base = next(
            x["s"] for x in runs if x["round"] == row["round"] and x["arm"] == "room for both"
        )
        spans = "  ".join(f"{a:5.1f}-{b:5.1f} s" for a, b in row["spans"])
        print(
            f"round {row['round']}  {row['arm']:<34} {row['s']:7.1f} s  "
            f"{row['loads']:3d} loads  {row['s'] / base:5.2f}x  records {spans}"
        )
    OUT.mkdir(exist_ok=True)
    (OUT / "affine.json").write_text(json.dumps(runs, indent=1))


if __name__ == "__main__":
    main()
