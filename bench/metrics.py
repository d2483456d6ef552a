"""What a Prometheus scrape costs with a large fleet: seconds and Redis commands.

A local redis-server holds ``--workers`` registry entries (each with pairs, a batch,
a prefix cache and latency histograms), ``--queued`` job ids on one queue, 20 batches
and 8 running jobs per worker. Each scrape runs the exporter's collector through
prometheus_client's exposition (what ``/metrics`` returns); the figures are the
median of ``--scrapes`` scrapes, and the command count of one.

    .venv/bin/python -m bench.metrics [--workers 100] [--queued 1000000]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

from prometheus_client import generate_latest
from redis import Redis

from producer.localredis import LocalRedis
from producer.metrics import FleetCollector, registry_for
from schemas import keys
from schemas.fleet import BatchInfo, Histogram, PairStats, PrefixCacheInfo, WorkerInfo

OUT = Path(__file__).parent / "out"


class Counting:
    """A client wrapper that records the commands it sends (pipelined ones included)."""

    def __init__(self, conn: Redis) -> None:
        self.conn = conn
        self.commands: list[str] = []

    def pipeline(self, *args: Any, **kw: Any) -> Any:
        pipe = self.conn.pipeline(*args, **kw)
        execute = pipe.execute

        def counted(*a: Any, **k: Any) -> Any:
            self.commands += [str(call[0]).upper() for call, _ in pipe.command_stack]
            return execute(*a, **k)

        pipe.execute = counted  # type: ignore[method-assign]
        return pipe

    def __getattr__(self, name: str) -> Any:
        self.commands.append(name.upper())
        return getattr(self.conn, name)


def fill(conn: Redis, workers: int, queued: int) -> None:
    queue = keys.rq_queue_key("mlxq")
    conn.sadd(keys.RQ_QUEUES, queue)
    chunk = 20_000
    for start in range(0, queued, chunk):
        ids = [f"big-{i:020x}" for i in range(start, min(start + chunk, queued))]
        conn.rpush(queue, *ids)
    now = time.time()
    pipe = conn.pipeline(transaction=False)
    for b in range(20):
        pipe.hset(keys.batch_key(f"b{b}"), mapping={"total": 1000, "succeeded": 10 * b})
        pipe.zadd(keys.BATCHES, {f"b{b}": now + b})
    for w in range(workers):
        latency = {k: Histogram() for k in ("queue_wait", "time_to_first_token", "job")}
        for h in latency.values():
            for i in range(50):
                h.observe(0.01 * i)
        info = WorkerInfo(
            name=f"mini-{w}",
            host=f"mini-{w}",
            pid=1000 + w,
            queues=["mlxq.interactive", "mlxq"],
            state="busy",
            pairs=[PairStats(target="t", draft="d", jobs=5, tokens=500, seconds=5.0, proposed=9)],
            prefix_cache=PrefixCacheInfo(budget_mb=1000, lookups=5, hits=3),
            batch=BatchInfo(model="t", size=8, limit=16, reason="memory", kv_mb=100.0),
            jobs_succeeded=50,
            latency=latency,
            lease_s=30.0,
            updated_at=now,
        )
        pipe.set(keys.worker_key(info.name), info.model_dump_json())
        pipe.zadd(keys.WORKERS, {info.name: now})
        token = f"tok{w}"
        pipe.zadd(keys.LEASES, {token: int(now * 1000) + 20_000})
        pipe.hset(keys.HOLDERS, token, json.dumps({"name": info.name}))
        for j in range(8):
            pipe.hset(keys.RUNNING, f"b{j}-{w:010x}{j:010x}", f"{token} mlxq")
    pipe.execute()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=100)
    ap.add_argument("--queued", type=int, default=1_000_000)
    ap.add_argument("--scrapes", type=int, default=20)
    args = ap.parse_args()
    with LocalRedis() as server:
        conn = Redis.from_url(server.url)
        start = time.perf_counter()
        fill(conn, args.workers, args.queued)
        filled_s = time.perf_counter() - start
        registry = registry_for(conn)
        times, size = [], 0
        for _ in range(args.scrapes):
            start = time.perf_counter()
            size = len(generate_latest(registry))
            times.append(time.perf_counter() - start)
        counting = Counting(conn)
        state = FleetCollector(counting).read()  # type: ignore[arg-type]
        assert state["queues"]["mlxq"][0] == args.queued
        result = {
            "workers": args.workers,
            "queued": args.queued,
            "fill_s": round(filled_s, 1),
            "scrape_ms_median": round(statistics.median(times) * 1000, 2),
            "scrape_ms_max": round(max(times) * 1000, 2),
            "redis_commands_per_scrape": len(counting.commands),
            "round_trips_per_scrape": 2,
            "exposition_bytes": size,
        }
    print(json.dumps(result, indent=1))
    OUT.mkdir(exist_ok=True)
    (OUT / "metrics.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
