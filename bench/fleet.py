"""Fleet simulation: N worker processes on one Redis, each job's compute replaced by a sleep.

Shows the queue layer's overhead and scaling: jobs/s against the ideal
(workers / sleep), and against plain RQ SimpleWorkers running the same sleep (the
anchor: RQ's own per-job cost, with no leases, validation or result records).
Generation is SIMULATED by a fixed sleep (bench/fleet_worker.py); dequeue, leases,
validation and result writing are the real code.

    .venv/bin/python -m bench.fleet [--workers 1,2,4,8] [--sleep-ms 50] [--jobs-per-worker 40]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from redis import Redis
from rq import Queue
from rq.serializers import JSONSerializer

from bench.plots import grouped_bars
from producer import Client
from producer.localredis import LocalRedis
from schemas import keys

OUT = Path(__file__).parent / "out"


def _start(url: str, workers: int, sleep_s: float, kind: str) -> list[subprocess.Popen[bytes]]:
    def argv(i: int) -> list[str]:
        if kind == "rq":
            return ["--rq", url, f"r{i}"]
        return [str(sleep_s), "--name", f"f{i}", "--max-batch", "1"]

    return [
        subprocess.Popen(
            [sys.executable, "-m", "bench.fleet_worker", *argv(i)],
            env=os.environ | {"MLXQ_REDIS_URL": url},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for i in range(workers)
    ]


def run(url: str, workers: int, sleep_s: float, jobs: int, kind: str, tenants: int = 0) -> float:
    """Jobs/s of ``workers`` processes: mlxq workers, or plain RQ SimpleWorkers (``kind="rq"``).
    ``tenants`` > 0: the jobs are that many tenants' batches, submitted one after another
    (fair share interleaves them)."""
    conn = Redis.from_url(url)
    conn.flushall()
    procs = _start(url, workers, sleep_s, kind)
    try:
        deadline = time.monotonic() + 60
        while conn.scard("rq:workers") < workers:  # all started and listening
            if time.monotonic() > deadline:
                raise SystemExit("workers did not start")
            time.sleep(0.05)
        start = time.monotonic()
        done_key = "bench:rq-anchor:done"
        if kind == "rq":
            queue = Queue("rq-anchor", connection=conn, serializer=JSONSerializer)
            func = "bench.fleet_worker.rq_sleep_job"
            queue.enqueue_many(
                [Queue.prepare_data(func, args=(sleep_s, done_key)) for _ in range(jobs)]
            )
        else:
            body = {"model": "simulated", "messages": [{"role": "user", "content": "x"}]}
            names = [f"t{i}" for i in range(tenants)] or [keys.DEFAULT_TENANT]
            batches = [
                Client(connection=conn).submit([body] * (jobs // len(names)), tenant=name).batch_id
                for name in names
            ]
        done_keys = [done_key] if kind == "rq" else [keys.batch_done_key(b) for b in batches]
        for _ in range(jobs):  # block on the done lists: no polling load on the 2 cores
            if conn.blpop(done_keys, timeout=60) is None:
                raise SystemExit("fleet stalled")
        elapsed = time.monotonic() - start
        if kind != "rq":
            succeeded = sum(int(conn.hget(keys.batch_key(b), "succeeded") or 0) for b in batches)
            if succeeded != jobs:
                raise SystemExit(f"only {succeeded} of {jobs} simulated jobs succeeded")
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
                raise SystemExit(f"a {kind} worker ignored SIGTERM for 30 s") from None
    return jobs / elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", default="1,2,4,8")
    ap.add_argument("--sleep-ms", type=float, default=50)
    ap.add_argument("--jobs-per-worker", type=int, default=40)
    ap.add_argument(
        "--tenants",
        type=int,
        default=0,
        help="Compare 1 tenant with this many (fair share) instead of mlxq with plain RQ.",
    )
    ap.add_argument("--rounds", type=int, default=2, help="Rounds of the --tenants comparison.")
    args = ap.parse_args()
    sleep_s = args.sleep_ms / 1000
    if args.tenants:
        return _tenants(args, sleep_s)
    rows = []
    print("SIMULATED compute: each job sleeps", args.sleep_ms, "ms instead of generating")
    with LocalRedis() as server:
        for n in (int(x) for x in args.workers.split(",")):
            jobs = n * args.jobs_per_worker
            rate = run(server.url, n, sleep_s, jobs, "mlxq")
            anchor = run(server.url, n, sleep_s, jobs, "rq")
            ideal = n / sleep_s
            rows.append(
                {
                    "workers": n,
                    "jobs_per_s": round(rate, 1),
                    "plain_rq_jobs_per_s": round(anchor, 1),
                    "ideal_jobs_per_s": ideal,
                    "of_ideal": round(rate / ideal, 3),
                    "plain_rq_of_ideal": round(anchor / ideal, 3),
                    "of_plain_rq": round(rate / anchor, 3),
                }
            )
            print(rows[-1], flush=True)
    OUT.mkdir(exist_ok=True)
    report = {"simulated_compute_ms": args.sleep_ms, "rows": rows}
    (OUT / "fleet.json").write_text(json.dumps(report, indent=1))
    grouped_bars(
        OUT / "fleet.png",
        f"Fleet simulation ({args.sleep_ms:g} ms simulated jobs)",
        [str(r["workers"]) for r in rows],
        {
            "mlxq": [r["jobs_per_s"] for r in rows],
            "plain RQ SimpleWorker": [r["plain_rq_jobs_per_s"] for r in rows],
            "ideal": [r["ideal_jobs_per_s"] for r in rows],
        },
        "jobs/s",
    )


def _tenants(args: argparse.Namespace, sleep_s: float) -> None:
    """Jobs/s with all jobs one tenant's vs spread over ``--tenants``, alternated."""
    print("SIMULATED compute: each job sleeps", args.sleep_ms, "ms instead of generating")
    with LocalRedis() as server:
        for n in (int(x) for x in args.workers.split(",")):
            jobs = n * args.jobs_per_worker
            one, many = [], []
            for _ in range(args.rounds):
                one.append(run(server.url, n, sleep_s, jobs, "mlxq", tenants=1))
                many.append(run(server.url, n, sleep_s, jobs, "mlxq", tenants=args.tenants))
            print(
                f"{n} workers, {jobs} jobs: 1 tenant {[round(x, 1) for x in one]} jobs/s, "
                f"{args.tenants} tenants {[round(x, 1) for x in many]} jobs/s; "
                f"best {max(many) / max(one):.3f}, median {_mid(many) / _mid(one):.3f}",
                flush=True,
            )


def _mid(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2]


if __name__ == "__main__":
    main()
