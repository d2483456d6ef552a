"""Soak: hundreds of jobs, several worker processes, random SIGKILLs and restarts.

Counts what the promise is about: every job ends with exactly one result record.

    .venv/bin/python -m bench.soak [--jobs 300] [--workers 3] [--seconds 240] [--max-batch 8]
        [--tenants N] [--batches N] [--mixed]

``--max-batch 1`` runs every job on the one-at-a-time path; the default runs them
in continuous batches (one kill hands back several jobs). ``--mixed``: every 5th job is
sampled with a seed and every 7th asks for 3 seeded choices (rows of n sequences in the
batches); each of those must end with all its choices.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

from redis import Redis

from producer import Client
from producer.localredis import LocalRedis
from schemas import keys
from worker.dev.tinymodels import TinySpec, ensure_model

OUT = Path(__file__).parent / "out"


def start_worker(url: str, name: str, lease: int, max_batch: int) -> subprocess.Popen:
    exe = str(Path(sys.executable).with_name("worker"))
    env = os.environ | {"MLXQ_REDIS_URL": url, "MLXQ_MODEL_DIRS": str(OUT)}
    args = ["--name", name, "--lease-seconds", str(lease), "--max-crashes", "5"]
    return subprocess.Popen(
        [exe, *args, "--max-batch", str(max_batch)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=300)
    ap.add_argument("--workers", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=240, help="give up after this long")
    ap.add_argument("--lease", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-batch", type=int, default=8, help="the workers' --max-batch")
    ap.add_argument("--tenants", type=int, default=0, help="split the jobs over N tenants")
    ap.add_argument("--batches", type=int, default=1, help="N batches per tenant (they take turns)")
    ap.add_argument("--mixed", action="store_true", help="seeded and n = 3 jobs among the rest")
    args = ap.parse_args()
    rng = random.Random(args.seed)
    OUT.mkdir(exist_ok=True)
    model = str(
        ensure_model(
            OUT / "soak-model",
            TinySpec(layers=2, hidden=128, intermediate=256, context=4096, seed=21),
        )
    )
    kills = restarts = same_name = 0
    with LocalRedis() as server:
        conn = Redis.from_url(server.url)
        requests = {
            f"j{i}": {
                "model": model,
                "temperature": 0,
                "max_tokens": rng.choice([8, 64, 400]),
                "logit_bias": {"3": -100},
                "messages": [{"role": "user", "content": f"job {i}"}],
            }
            for i in range(args.jobs)
        }
        choices = {f"j{i}" for i in range(3, args.jobs, 7)} if args.mixed else set()
        seeded = {f"j{i}" for i in range(1, args.jobs, 5)} if args.mixed else set()
        for cid in choices | seeded:  # sampled with a seed; 3 choices for the choice jobs
            requests[cid] |= {
                "temperature": 0.8,
                "seed": int(cid[1:]),
                "n": 1 + 2 * (cid in choices),
            }
        # --tenants N: N tenants' batches sharing the queue fairly (fair.lua on every take,
        # requeue and recovery); --batches N: each tenant's batches taking turns (a ring)
        names = [f"t{i}" for i in range(args.tenants)] or [keys.DEFAULT_TENANT]
        parts = [name for name in names for _ in range(args.batches)]
        items = list(requests.items())
        summaries = [
            Client(connection=conn).submit(dict(items[i :: len(parts)]), tenant=name)
            for i, name in enumerate(parts)
        ]
        batch_keys = [keys.batch_key(s.batch_id) for s in summaries]
        procs = {
            f"w{i}": start_worker(server.url, f"w{i}", args.lease, args.max_batch)
            for i in range(args.workers)
        }
        start = time.monotonic()
        next_kill = start + rng.uniform(1, 4)
        while time.monotonic() - start < args.seconds:
            done = sum(
                int(conn.hget(k, "succeeded") or 0) + int(conn.hget(k, "failed") or 0)
                for k in batch_keys
            )
            if done >= args.jobs:
                break
            if time.monotonic() >= next_kill:
                name = rng.choice(sorted(procs))
                procs[name].send_signal(signal.SIGKILL)
                procs[name].wait()
                kills += 1
                reuse = rng.random() < 0.5
                new_name = name if reuse else f"{name}-{kills}"
                same_name += reuse
                del procs[name]
                procs[new_name] = start_worker(server.url, new_name, args.lease, args.max_batch)
                restarts += 1
                next_kill = time.monotonic() + rng.uniform(1, 4)
            time.sleep(0.1)
        elapsed = time.monotonic() - start
        for p in procs.values():
            p.send_signal(signal.SIGTERM)
        for p in procs.values():
            p.wait(60)
        ids = [j for s in summaries for j in s.job_ids]
        results = conn.mget([keys.result_key(j) for j in ids])
        records = [json.loads(r) for r in results if r]
        announced = [
            j.decode()
            for s in summaries
            for j in conn.lrange(keys.batch_done_key(s.batch_id), 0, -1)
        ]
        report = {
            "jobs_submitted": args.jobs,
            "tenants": args.tenants,
            "batches_per_tenant": args.batches,
            "workers": args.workers,
            "max_batch": args.max_batch,
            "kills_sigkill": kills,
            "restarts": restarts,
            "restarts_same_name": same_name,
            "jobs_with_result": len(records),
            "succeeded": sum(r["status"] == "succeeded" for r in records),
            "failed": sum(r["status"] == "failed" for r in records),
            "failed_reasons": sorted({r["error"]["code"] for r in records if r["error"]}),
            "results_duplicated": len(announced) - len(set(announced)),
            "jobs_lost": args.jobs - len(records),
            "requeued_after_crash": sum(int(conn.get(keys.crashes_key(j)) or 0) for j in ids),
            "choice_jobs_short": sum(
                len(r["response"]["choices"]) != 3
                for r in records
                if r["custom_id"] in choices and r["status"] == "succeeded"
            ),
            "seconds": round(elapsed, 1),
        }
    (OUT / "soak.json").write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))
    if report["jobs_lost"] or report["results_duplicated"] or report["choice_jobs_short"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
