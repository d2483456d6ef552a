"""Stopping running jobs: seconds from the stop to the record, against a step's seconds.

One worker (in-process, ``--max-batch 8``) on the 12x1024 target, its gateway in front.
Arms, each ``--rounds`` times:

- cancel: a batch of 8 jobs of 4,000 tokens decoding together; ``producer cancel`` once
  each has made tokens; seconds until every record is written, over the batch's step;
- disconnect: a streamed chat completion read for 3 chunks, then its socket closed;
  seconds until its record is written, over its step (one token);
- time limit: a job asking ``time_limit_s: 2``; seconds past the limit at its record.

Before this change none of them stopped: a cancelled running job, or one whose client
went away, ran to ``max_tokens`` (printed: the seconds that would have taken, from the
job's measured speed). Goal: under 1 s plus one step.

    .venv/bin/python -m bench.stop [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import threading
import time
from pathlib import Path

from redis import Redis

from bench.fixtures import model
from bench.gateway import KEY, start_gateway
from bench.interactive import serve
from producer import Client
from producer.localredis import LocalRedis
from schemas import ResultRecord, keys
from schemas.store import read_result
from worker.engine.models import ModelCache
from worker.runner.runtime import WorkerRuntime

OUT = Path(__file__).parent / "out"
TOKENS = 4000


def job(target: str, i: int, **fields: object) -> dict:
    return {
        "model": target,
        "messages": [{"role": "user", "content": f"stop me {i}"}],
        "max_tokens": TOKENS,
        "temperature": 0,
        "logit_bias": {"3": -100},  # (no early EOS)
    } | fields


def until(what, every: float = 0.005, timeout: float = 600.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if got := what():
            return got
        time.sleep(every)
    raise SystemExit("timed out")


def step_s(record: ResultRecord) -> float:
    """One step of the job's batch (its tokens over its decode time, per token)."""
    usage, m = record.partial.usage, record.metrics
    decode = m.total_time_s - (m.time_to_first_token_s or 0.0) - (m.queue_wait_s or 0.0)
    return max(decode, 1e-9) / max(usage.completion_tokens - 1, 1)


def cancel_arm(conn: Redis, target: str, tag: str) -> dict:
    client = Client(connection=conn)
    s = client.submit({f"{tag}{i}": job(target, i) for i in range(8)}, batch_id=tag)
    until(lambda: conn.hlen(keys.RUNNING) == 8)
    time.sleep(1.0)  # every row decoding
    stopped = time.perf_counter()
    client.cancel(tag)
    records = []
    for j in s.job_ids:
        records.append(until(lambda j=j: read_result(conn, j)))
    took = time.perf_counter() - stopped
    step = statistics.median(step_s(r) for r in records)
    made = statistics.median(r.partial.usage.completion_tokens for r in records)
    return {"stop_s": took, "step_s": step, "steps": took / step, "saved_s": (TOKENS - made) * step}


def disconnect_arm(conn: Redis, base: str, target: str, i: int) -> dict:
    host, port = base.removeprefix("http://").removesuffix("/v1").split(":")
    body = json.dumps(job(target, i, stream=True)).encode()
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(head + body)
        got = b""
        while got.count(b"data: ") < 3:
            got += sock.recv(4096)
        job_id = got.split(b"x-mlxq-job-id: ")[1].split(b"\r\n")[0].decode()
        stopped = time.perf_counter()
    record = until(lambda: read_result(conn, job_id))
    took = time.perf_counter() - stopped
    step = step_s(record)
    made = record.partial.usage.completion_tokens
    return {"stop_s": took, "step_s": step, "steps": took / step, "saved_s": (TOKENS - made) * step}


def limit_arm(conn: Redis, target: str, i: int) -> dict:
    s = Client(connection=conn).submit([job(target, i, time_limit_s=2)])
    record = until(lambda: read_result(conn, s.job_ids[0]))
    over = record.metrics.total_time_s - 2
    step = step_s(record)
    return {"stop_s": over, "step_s": step, "steps": over / step, "code": record.error.code}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    target = model("wide")
    runs: dict[str, list[dict]] = {"cancel": [], "disconnect": [], "time limit": []}
    with LocalRedis() as r:
        conn = Redis.from_url(r.url)
        gateway, base = start_gateway(r.url, 1)
        halt = threading.Event()
        rt = WorkerRuntime(cache=ModelCache(), worker_id="bench-stop")
        serve(r.url, rt, 8, halt)
        try:
            for n in range(args.rounds):
                runs["cancel"].append(cancel_arm(conn, target, f"c{n}"))
                runs["disconnect"].append(disconnect_arm(conn, base, target, n))
                runs["time limit"].append(limit_arm(conn, target, n))
        finally:
            halt.set()
            gateway.terminate()
    print(f"{'arm':<11} {'stop -> record s':>17} {'step s':>7} {'steps':>6} {'saved s':>8}")
    for arm, rows in runs.items():
        for row in rows:
            saved = f"{row['saved_s']:8.1f}" if "saved_s" in row else f"{'-':>8}"
            print(
                f"{arm:<11} {row['stop_s']:17.3f} {row['step_s']:7.3f} {row['steps']:6.1f} {saved}"
            )
    OUT.mkdir(exist_ok=True)
    (OUT / "stop.json").write_text(json.dumps(runs, indent=1))


if __name__ == "__main__":
    main()
