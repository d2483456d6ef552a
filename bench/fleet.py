"""Fleet simulation: N worker processes on one Redis, each job's compute replaced by a sleep.

Shows the queue layer's overhead and scaling: jobs/s against the ideal
(workers / sleep). Generation is SIMULATED by a fixed sleep (bench/fleet_worker.py);
dequeue, leases, validation and result writing are the real code.

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

from bench.plots import grouped_bars
from producer import Client
from producer.localredis import LocalRedis
from schemas import keys

OUT = Path(__file__).parent / "out"


def run(url: str, workers: int, sleep_s: float, jobs: int) -> float:
    conn = Redis.from_url(url)
    conn.flushall()
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "bench.fleet_worker",
                str(sleep_s),
                "--name",
                f"f{i}",
                "--max-batch",
                "1",
            ],
            env=os.environ | {"MLXQ_REDIS_URL": url},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for i in range(workers)
    ]
    try:
        deadline = time.monotonic() + 60
        while Redis.from_url(url).scard("rq:workers") < workers:  # all started and listening
            if time.monotonic() > deadline:
                raise SystemExit("workers did not start")
            time.sleep(0.05)
        body = {"model": "simulated", "messages": [{"role": "user", "content": "x"}]}
        start = time.monotonic()
        s = Client(connection=conn).submit([body] * jobs)
        done_key = keys.batch_done_key(s.batch_id)
        for _ in range(jobs):  # block on the done list: no polling load on the 2 cores
            if conn.blpop([done_key], timeout=60) is None:
                raise SystemExit("fleet stalled")
        elapsed = time.monotonic() - start
        succeeded = int(conn.hget(keys.batch_key(s.batch_id), "succeeded") or 0)
        if succeeded != jobs:
            raise SystemExit(f"only {succeeded} of {jobs} simulated jobs succeeded")
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            p.wait(30)
    return jobs / elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", default="1,2,4,8")
    ap.add_argument("--sleep-ms", type=float, default=50)
    ap.add_argument("--jobs-per-worker", type=int, default=40)
    args = ap.parse_args()
    sleep_s = args.sleep_ms / 1000
    rows = []
    print("SIMULATED compute: each job sleeps", args.sleep_ms, "ms instead of generating")
    with LocalRedis() as server:
        for n in (int(x) for x in args.workers.split(",")):
            rate = run(server.url, n, sleep_s, n * args.jobs_per_worker)
            ideal = n / sleep_s
            rows.append(
                {
                    "workers": n,
                    "jobs_per_s": round(rate, 1),
                    "ideal_jobs_per_s": ideal,
                    "of_ideal": round(rate / ideal, 3),
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
            "measured": [r["jobs_per_s"] for r in rows],
            "ideal": [r["ideal_jobs_per_s"] for r in rows],
        },
        "jobs/s",
    )


if __name__ == "__main__":
    main()
