"""Serve submitted jobs with one in-process mlxq worker (the real Redis and queue path)."""

from __future__ import annotations

import time

from redis import Redis

from producer import Client
from schemas import ResultRecord
from worker.runner import runtime
from worker.runner.loop import Worker


def burst(
    conn: Redis,
    bodies: list[dict],
    rt: runtime.WorkerRuntime | None = None,
    max_batch: int | None = 1,
    queues: tuple[str, ...] = ("mlxq",),
) -> tuple[list[ResultRecord], float]:
    """Submit ``bodies`` (to ``mlxq``) and serve them with a burst worker serving ``queues``
    (a fresh runtime without ``rt``).

    Returns every job's result record, in order, and the seconds from submit to
    the last result. Exits if a job did not succeed: a benchmark of failures
    measures nothing.
    """
    rt = rt or runtime.WorkerRuntime()
    client = Client(connection=conn)
    start = time.perf_counter()
    s = client.submit(bodies)
    name = f"bench{time.monotonic_ns()}"
    Worker(conn, list(queues), rt, name=name, max_batch=max_batch, burst=True).work()
    elapsed = time.perf_counter() - start
    records = client.results(s.batch_id)
    failed = [r for r in records if r is None or r.status != "succeeded"]
    if failed:
        raise SystemExit(f"{len(failed)} of {len(records)} jobs did not succeed: {failed[0]}")
    return [r for r in records if r is not None], elapsed
