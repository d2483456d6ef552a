"""The fleet registry: each worker publishes its state with a TTL; dead workers vanish."""

from __future__ import annotations

import os
import socket
import time

from redis import Redis

from schemas import keys
from schemas.fleet import LoadedModelInfo, WorkerInfo
from worker.runtime import WorkerRuntime


def worker_info(
    rt: WorkerRuntime, name: str, queues: list[str], state: str, current_job: str | None
) -> WorkerInfo:
    cache = rt.cache
    return WorkerInfo(
        name=name,
        host=socket.gethostname(),
        pid=os.getpid(),
        queues=queues,
        state=state,
        current_job=current_job,
        models=[
            LoadedModelInfo(
                name=e.name, adapter=e.adapter, memory_mb=round(e.nbytes / 1e6, 1), pinned=e.pinned
            )
            for e in cache.entries()
        ],
        cache_budget_gb=cache.budget_bytes / 1e9 if cache.budget_bytes else None,
        cache_used_gb=round(cache.used_bytes / 1e9, 3),
        jobs_done=rt.stats.jobs_done,
        pairs=list(rt.stats.pairs.values()),
        speculation=rt.policy.summary(),
        updated_at=time.time(),
    )


def publish(conn: Redis, info: WorkerInfo, ttl: int) -> None:
    """Write the worker's entry; it disappears ``ttl`` seconds after the last publish."""
    pipe = conn.pipeline(transaction=False)
    pipe.set(keys.worker_key(info.name), info.model_dump_json(), ex=ttl)
    pipe.zadd(keys.WORKERS, {info.name: info.updated_at})
    pipe.execute()


def unpublish(conn: Redis, name: str) -> None:
    pipe = conn.pipeline(transaction=False)
    pipe.delete(keys.worker_key(name))
    pipe.zrem(keys.WORKERS, name)
    pipe.execute()
