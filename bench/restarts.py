"""Auto across process restarts: a fresh worker after another one learned, side by side.

A "learner" worker serves N jobs of a (target, draft) pair with ``--speculative
auto`` and shares its figures in a local Redis (``--share-figures``). Then, each
round, the same N greedy jobs run through fresh in-process workers (a new policy
each, as after a restart or on a new Mac of the same kind), back to back:

- plain (``--speculative never``) and each fixed k (``always`` at k);
- fresh, not sharing: auto from scratch, what every restart paid before;
- fresh, sharing: auto starting from the fleet's figures.

Throughput is completion tokens over the wall seconds of serving them (models
stay loaded in one model cache: loading is not what is compared).

    .venv/bin/python -m bench.restarts [--pairs unrelated,copy] [--jobs 12] [--rounds 2]
    .venv/bin/python -m bench.restarts --max-batch auto   # batches too: their sizes shared
    .venv/bin/python -m bench.restarts --target T --draft D --ks 1,2,3   # e.g. bench/real.sh
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from redis import Redis

from bench.fixtures import model
from producer import Client
from producer.localredis import LocalRedis
from schemas.store import read_result
from worker.engine.models import ModelCache
from worker.runner.loop import Worker
from worker.runner.runtime import WorkerRuntime
from worker.schedule.policy import SpeculationPolicy

OUT = Path(__file__).parent / "out"


def serve(
    url: str,
    target: str,
    draft: str,
    n: int,
    tokens: int,
    tag: str,
    rt: WorkerRuntime,
    max_batch: int | None = 1,
) -> dict:
    """Submit ``n`` jobs and serve them with a fresh worker on ``rt``: tokens/s and arms."""
    conn = Redis.from_url(url)
    jobs = [
        {
            "model": target,
            "draft_model": draft,
            "temperature": 0,
            "max_tokens": tokens,
            "messages": [{"role": "user", "content": f"Job {i}: tell me about queues."}],
        }
        for i in range(n)
    ]
    s = Client(connection=conn).submit(jobs, batch_id=tag)
    worker = Worker(conn, ["mlxq"], rt, name=tag, max_batch=max_batch, burst=True)
    start = time.perf_counter()
    worker.work()
    seconds = time.perf_counter() - start
    records = [read_result(conn, j) for j in s.job_ids]
    done = sum(r.response.usage.completion_tokens for r in records if r.response)
    reasons = [r.metrics.speculation_reason or "" for r in records if r.metrics]
    return {
        "tok_s": done / seconds,
        "measuring_jobs": sum(r.startswith("auto: measuring") for r in reasons),
        "arms": [r.split(" (")[0].split(";")[0] for r in reasons],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", default="unrelated,copy", help="of: unrelated, copy")
    ap.add_argument("--target", help="a target (path or hub id) instead of the synthetic pairs")
    ap.add_argument("--draft", help="its draft")
    ap.add_argument("--ks", default=None, help="fixed k arms, e.g. 1,2,3")
    ap.add_argument("--jobs", type=int, default=12)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument(
        "--max-batch",
        default="1",
        help="1: jobs one at a time (speculation's figures); auto: batches too (their sizes)",
    )
    args = ap.parse_args()
    if args.target:
        pairs = {"given": (args.target, args.draft, args.ks or "1,2,3")}
    else:
        wide = model("wide")
        known = {
            "unrelated": (wide, model("unrelated"), "1,2"),
            "copy": (wide, model("copy"), "2,4,6"),
        }
        pairs = {p: known[p] for p in args.pairs.split(",")}
    max_batch = None if args.max_batch == "auto" else int(args.max_batch)
    cache = ModelCache()
    report: dict = {
        "jobs": args.jobs,
        "max_tokens": args.max_tokens,
        "max_batch": args.max_batch,
        "pairs": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        server = LocalRedis(data_dir=Path(tmp))
        server.start()
        try:
            for name, (target, draft, ks) in pairs.items():
                Redis.from_url(server.url).flushall()

                def rt(mode: str, k: int = 3, share: bool = False) -> WorkerRuntime:
                    policy = SpeculationPolicy(mode, default_k=k)
                    return WorkerRuntime(cache=cache, policy=policy, share_figures=share)

                def run(tag: str, runtime: WorkerRuntime, t: str = target, d: str = draft) -> dict:
                    return serve(
                        server.url, t, d, args.jobs, args.max_tokens, tag, runtime, max_batch
                    )

                run(f"{name}-warm", rt("never"))  # load the models, warm the kernels
                learner = run(f"{name}-learner", rt("auto", share=True))
                arms: dict[str, list[dict]] = {}
                for r in range(args.rounds):
                    todo = {"plain": rt("never")}
                    todo |= {f"k={k}": rt("always", int(k)) for k in ks.split(",")}
                    todo |= {
                        "fresh, not sharing": rt("auto"),
                        "fresh, sharing": rt("auto", share=True),
                    }
                    for i, (arm, runtime) in enumerate(todo.items()):
                        arms.setdefault(arm, []).append(run(f"{name}-{r}-{i}", runtime))
                rate = {a: sum(x["tok_s"] for x in v) / len(v) for a, v in arms.items()}
                fixed = {a: v for a, v in rate.items() if not a.startswith("fresh")}
                best = max(fixed, key=fixed.__getitem__)
                row = {
                    "target": target,
                    "draft": draft,
                    "tok_s": {a: round(v, 2) for a, v in rate.items()},
                    "best_fixed": best,
                    "learner_measuring_jobs": learner["measuring_jobs"],
                    "measuring_jobs": {
                        a: [x["measuring_jobs"] for x in arms[a]]
                        for a in ("fresh, not sharing", "fresh, sharing")
                    },
                    "sharing_arms": arms["fresh, sharing"][0]["arms"],
                    "sharing_over_plain": round(rate["fresh, sharing"] / rate["plain"], 3),
                    "sharing_over_best": round(rate["fresh, sharing"] / rate[best], 3),
                    "not_sharing_over_plain": round(rate["fresh, not sharing"] / rate["plain"], 3),
                    "not_sharing_over_best": round(rate["fresh, not sharing"] / rate[best], 3),
                }
                report["pairs"][name] = row
                print(name, json.dumps(row), flush=True)
        finally:
            server.stop()
    OUT.mkdir(exist_ok=True)
    suffix = "" if args.max_batch == "1" else f"-batch-{args.max_batch}"
    (OUT / f"restarts{suffix}.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
