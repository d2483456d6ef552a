"""Batches of a million jobs: submit, cancel, results export, Redis latency and bytes per job.

One private redis-server, one run, side by side:

- ``producer submit`` of an N-line OpenAI Batch file (a real subprocess: wall
  time and its peak RSS) vs raw RQ ``enqueue_many`` of the same payloads in the
  same chunk size (only the enqueue calls timed: RQ gets ready payloads);
- Redis bytes per queued job, mlxq's layout vs RQ's (what mlxq stored before);
- ``producer cancel`` of the N queued jobs (a subprocess);
- ``producer results -o`` of R finished jobs, ended through the real job
  lifecycle (take, end) by a stand-in worker that writes a 64-token answer;
  Redis bytes per finished job;
- Redis's own latency during each step: the server's latency monitor (threshold
  5 ms, the largest event of each step) and a separate process that PINGs every
  10 ms (what any other client waits).

Run:  .venv/bin/python -m bench.bigbatch [--lines 1000000] [--results 200000]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from redis import Redis
from rq import Queue
from rq.serializers import JSONSerializer

from producer.localredis import LocalRedis
from schemas import ChatCompletion, Choice, Metrics, ResultRecord, Usage, keys
from schemas.result import AssistantMessage
from worker.lifecycle.held import Lifecycle

OUT = Path(__file__).parent / "out"
PRODUCER = str(Path(sys.executable).with_name("producer"))
CHUNK = 1000
MODEL = "mlx-community/Qwen2.5-0.5B-Instruct-4bit"

_PINGER = """
import sys, time
from redis import Redis
conn, worst, out = Redis.from_url(sys.argv[1]), 0.0, sys.argv[2]
while True:
    t = time.perf_counter(); conn.ping(); worst = max(worst, time.perf_counter() - t)
    open(out, "w").write(repr(worst * 1000)) if worst * 1000 > 1 else None
    time.sleep(0.01)
"""


def write_file(path: Path, n: int) -> None:
    with open(path, "w") as f:
        for i in range(n):
            body = {
                "model": MODEL,
                "messages": [
                    {"role": "system", "content": "You are terse."},
                    {"role": "user", "content": f"Summarise record {i} in one line."},
                ],
                "max_tokens": 64,
                "temperature": 0,
            }
            line = {"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions"}
            f.write(json.dumps(line | {"body": body}) + "\n")


@contextmanager
def latency(conn: Redis, url: str, into: dict, step: str) -> Iterator[None]:
    """Record the server's worst latency event and the worst PING seen during the block."""
    conn.latency_reset()
    out = OUT / f"ping-{os.getpid()}.txt"
    out.unlink(missing_ok=True)
    pinger = subprocess.Popen([sys.executable, "-c", _PINGER, url, str(out)])
    time.sleep(0.3)
    start = time.perf_counter()
    try:
        yield
    finally:
        into[f"{step}_s"] = round(time.perf_counter() - start, 2)
        pinger.kill()
        pinger.wait()
        events = conn.execute_command("LATENCY", "LATEST")
        worst = max((int(e[2]) for e in events), default=0)
        into[f"{step}_redis_worst_event_ms"] = worst
        into[f"{step}_ping_worst_ms"] = round(float(out.read_text()), 1) if out.exists() else 1.0
        out.unlink(missing_ok=True)


def submit(path: Path, url: str, batch_id: str) -> tuple[float, float]:
    """``producer submit`` in a subprocess: (seconds, peak RSS MB)."""
    start = time.perf_counter()
    proc = subprocess.Popen(
        [PRODUCER, "submit", str(path), "--redis-url", url, "--batch-id", batch_id, "--json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    _, status, usage = os.wait4(proc.pid, 0)
    elapsed = time.perf_counter() - start
    if status != 0:
        raise SystemExit(f"producer submit failed ({status})")
    return elapsed, usage.ru_maxrss / 1024


def raw_rq(path: Path, conn: Redis, n: int) -> float:
    """Raw RQ enqueue_many of the same envelopes, chunk by chunk; only the enqueueing timed."""
    queue = Queue("raw", connection=conn, serializer=JSONSerializer)
    spent, now = 0.0, time.time()
    with open(path) as f:
        while True:
            lines = [json.loads(x) for _, x in zip(range(CHUNK), f, strict=False)]
            if not lines:
                return spent
            envelopes = [
                {
                    "job_id": keys.job_id_for("raw", x["custom_id"]),
                    "batch_id": "raw",
                    "custom_id": x["custom_id"],
                    "submitted_at": now,
                    "result_ttl": keys.DEFAULT_RESULT_TTL,
                    "request": x["body"],
                }
                for x in lines
            ]
            start = time.perf_counter()
            datas = [
                Queue.prepare_data(
                    keys.JOB_FUNCTION,
                    args=(e,),
                    job_id=e["job_id"],
                    timeout=3600,
                    result_ttl=keys.DEFAULT_RESULT_TTL,
                    failure_ttl=keys.DEFAULT_RESULT_TTL,
                    description=f"raw {e['custom_id']}",
                )
                for e in envelopes
            ]
            pipe = conn.pipeline()
            queue.enqueue_many(datas, pipeline=pipe)
            pipe.rpush(keys.batch_jobs_key("raw"), *[e["job_id"] for e in envelopes])
            pipe.execute()
            spent += time.perf_counter() - start


def answer(job_id: str, batch_id: str, custom_id: str) -> ResultRecord:
    """A finished job's record as a worker writes it: a 64-token answer and metrics."""
    text = "A terse one-line summary of the record, as a small model would write it. " * 4
    response = ChatCompletion(
        id=f"chatcmpl-{job_id}",
        created=int(time.time()),
        model=MODEL,
        choices=[Choice(message=AssistantMessage(content=text[:300]), finish_reason="stop")],
        usage=Usage(prompt_tokens=31, completion_tokens=64, total_tokens=95),
    )
    metrics = Metrics(
        worker_id="stand-in",
        queue_wait_s=1.5,
        time_to_first_token_s=0.05,
        generation_tokens_per_s=80.0,
        total_time_s=0.9,
    )
    return ResultRecord(
        job_id=job_id,
        batch_id=batch_id,
        custom_id=custom_id,
        status="succeeded",
        response=response,
        metrics=metrics,
        finished_at=time.time(),
    )


def finish_all(conn: Redis, queue: str, n: int) -> None:
    """End n jobs through the real lifecycle (take one by one, end in pipelines of 500)."""
    life = Lifecycle(conn, "stand-in", [queue])
    life.register()
    ended = []
    for _ in range(n):
        job = life.take()
        assert job is not None
        e = job.envelope
        ended.append((job, answer(job.id, e.batch_id, e.custom_id)))
        if len(ended) == 500:
            life.end_many(ended)
            ended = []
    if ended:
        life.end_many(ended)
    life.unregister()


def used(conn: Redis) -> int:
    return int(conn.info("memory")["used_memory"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lines", type=int, default=1_000_000)
    ap.add_argument("--results", type=int, default=200_000)
    args = ap.parse_args()
    OUT.mkdir(exist_ok=True)
    path = OUT / f"bigbatch-{args.lines}.jsonl"
    if not path.exists():
        write_file(path, args.lines)
    small = OUT / f"bigbatch-{args.results}.jsonl"
    if not small.exists():
        write_file(small, args.results)
    report: dict[str, object] = {"lines": args.lines, "file_mb": round(path.stat().st_size / 1e6)}
    with LocalRedis() as server:
        conn = Redis.from_url(server.url)
        conn.config_set("latency-monitor-threshold", 5)
        base = used(conn)
        with latency(conn, server.url, report, "raw_rq_enqueue"):
            raw = raw_rq(path, conn, args.lines)
        report["raw_rq_enqueue_s"] = round(raw, 2)
        report["raw_rq_jobs_per_s"] = round(args.lines / raw)
        report["rq_layout_bytes_per_queued_job"] = round((used(conn) - base) / args.lines)
        conn.flushall()
        base = used(conn)
        with latency(conn, server.url, report, "submit"):
            seconds, rss = submit(path, server.url, "big")
        assert conn.llen(keys.rq_queue_key(keys.DEFAULT_QUEUE)) == args.lines
        report["submit_jobs_per_s"] = round(args.lines / seconds)
        report["submit_peak_rss_mb"] = round(rss)
        report["submit_vs_raw_rq"] = round(raw / seconds, 3)
        report["mlxq_bytes_per_queued_job"] = round((used(conn) - base) / args.lines)
        with latency(conn, server.url, report, "status"):
            subprocess.run([PRODUCER, "status", "big", "--redis-url", server.url], check=True)
        with latency(conn, server.url, report, "cancel"):
            out = subprocess.run(
                [PRODUCER, "cancel", "big", "--redis-url", server.url],
                check=True,
                capture_output=True,
                text=True,
            ).stdout
        report["cancel_output"] = out.strip()
        assert conn.llen(keys.rq_queue_key(keys.DEFAULT_QUEUE)) == 0
        conn.flushall()
        # Results: R jobs finished through the real lifecycle, then exported.
        base = used(conn)
        subprocess.run(
            [PRODUCER, "submit", str(small), "--redis-url", server.url, "--batch-id", "done"],
            check=True,
            capture_output=True,
        )
        start = time.perf_counter()
        finish_all(conn, keys.DEFAULT_QUEUE, args.results)
        report["stand_in_finish_s"] = round(time.perf_counter() - start, 1)
        report["results"] = args.results
        report["mlxq_bytes_per_finished_job"] = round((used(conn) - base) / args.results)
        record_bytes = conn.memory_usage(keys.result_key(keys.job_id_for("done", "r5")))
        report["bytes_per_result_record"] = record_bytes
        out_file = OUT / "bigbatch-results.jsonl"
        with latency(conn, server.url, report, "results"):
            subprocess.run(
                [PRODUCER, "results", "done", "-o", str(out_file), "--redis-url", server.url],
                check=True,
                capture_output=True,
            )
        lines = out_file.read_bytes().count(b"\n")
        assert lines == args.results, lines
        report["results_lines_per_s"] = round(args.results / report["results_s"])  # type: ignore[operator]
        out_file.unlink()
    (OUT / "bigbatch.json").write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
