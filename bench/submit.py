"""Submit throughput: ``producer submit`` of an N-line file vs raw RQ ``enqueue_many``.

Both sides run in this process against one private redis-server, on the same
payloads, alternating rounds so machine noise hits both alike. Run:

    .venv/bin/python bench/submit.py [--lines 50000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from click.testing import CliRunner
from redis import Redis
from rq import Queue
from rq.serializers import JSONSerializer

from bench.plots import grouped_bars
from producer.cli import main as producer_main
from producer.lines import parse_file
from producer.localredis import LocalRedis
from producer.submit import SubmitItem, _envelope
from schemas import keys

OUT = Path(__file__).parent / "out"


def write_jobs(path: Path, n: int) -> None:
    with open(path, "w") as f:
        for i in range(n):
            body = {
                "messages": [
                    {"role": "system", "content": "You are terse."},
                    {"role": "user", "content": f"Summarise record {i} in one line."},
                ],
                "max_tokens": 64,
                "temperature": 0,
            }
            line = {
                "custom_id": f"r{i}",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": body | {"model": "mlx-community/Qwen2.5-0.5B-Instruct-4bit"},
            }
            f.write(json.dumps(line) + "\n")


def time_producer(path: Path, url: str, batch_id: str) -> float:
    start = time.perf_counter()
    result = CliRunner().invoke(
        producer_main, ["submit", str(path), "--redis-url", url, "--batch-id", batch_id]
    )
    elapsed = time.perf_counter() - start
    if result.exit_code != 0:
        raise SystemExit(result.output)
    return elapsed


def time_raw_rq(payloads: list[tuple[str, dict]], url: str, chunk: int = 1000) -> float:
    """Raw RQ: the same JSON payloads and job ids, enqueue_many in the same chunk size."""
    conn = Redis.from_url(url)
    queue = Queue("raw", connection=conn, serializer=JSONSerializer)
    start = time.perf_counter()
    for i in range(0, len(payloads), chunk):
        datas = [
            Queue.prepare_data(keys.JOB_FUNCTION, args=(p,), job_id=f"raw{job_id}")
            for job_id, p in payloads[i : i + chunk]
        ]
        pipe = conn.pipeline()
        queue.enqueue_many(datas, pipeline=pipe)
        pipe.execute()
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lines", type=int, default=50_000)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    OUT.mkdir(exist_ok=True)
    path = OUT / f"jobs-{args.lines}.jsonl"
    write_jobs(path, args.lines)
    parsed = parse_file(path)
    payloads = [
        (
            keys.job_id_for("raw", p.custom_id),
            _envelope(
                keys.job_id_for("raw", p.custom_id),
                "raw",
                SubmitItem(p.custom_id, p.request),
                time.time(),
                keys.DEFAULT_RESULT_TTL,
            ),
        )
        for p in parsed.lines
    ]
    prod, raw = [], []
    with LocalRedis() as server:
        conn = Redis.from_url(server.url)
        for r in range(args.rounds):
            conn.flushall()
            raw.append(time_raw_rq(payloads, server.url))
            conn.flushall()
            prod.append(time_producer(path, server.url, f"bench{r}"))
            assert conn.llen(keys.rq_queue_key(keys.DEFAULT_QUEUE)) == args.lines
    p_rate = args.lines / statistics.median(prod)
    r_rate = args.lines / statistics.median(raw)
    report = {
        "lines": args.lines,
        "rounds": args.rounds,
        "producer_submit_jobs_per_s": round(p_rate),
        "raw_rq_enqueue_many_jobs_per_s": round(r_rate),
        "ratio_producer_to_raw": round(p_rate / r_rate, 3),
        "note": "producer includes reading and validating the file; raw RQ gets ready payloads",
    }
    (OUT / "submit.json").write_text(json.dumps(report, indent=1))
    grouped_bars(
        OUT / "submit.png",
        f"Enqueue {args.lines:,} jobs",
        ["jobs/s"],
        {"producer submit": [p_rate], "raw RQ enqueue_many": [r_rate]},
        "jobs per second (median)",
    )
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
