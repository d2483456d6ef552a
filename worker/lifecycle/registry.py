"""A worker's public records: mlxq's fleet entry and RQ's worker record.

- ``mlxq:worker:<name>`` (JSON, short TTL): what ``producer fleet`` shows
  (models loaded, cache use, tokens/s and acceptance per pair). A dead worker
  vanishes with the TTL, a stopped one at once.
- ``rq:worker:<name>`` and RQ's worker sets: what ``rq info`` and rq-dashboard
  show (state, current job, queues, job counts). The lifecycle's scripts keep
  its state, current job, counters and heartbeat up to date.
"""

from __future__ import annotations

import os
import socket
import sys
from importlib.metadata import PackageNotFoundError, version

from redis import Redis

from schemas import keys
from schemas.fleet import WorkerInfo
from schemas.keys import rq_time
from worker.lifecycle.upkeep import alive


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


def claim_name(conn: Redis, name: str) -> None:
    """Raise RuntimeError if a live worker (on this host or another) uses ``name``.

    A record left by a dead process of ours on this host (a restart after a
    crash) is taken over.
    """
    key = keys.rq_worker_key(name)
    data = {k.decode(): v.decode() for k, v in conn.hgetall(key).items()}
    if not data or "death" in data:
        return
    pid, host = int(data.get("pid") or 0), data.get("hostname")
    if host != socket.gethostname():
        raise RuntimeError(
            f"worker name {name!r} is in use by a worker on host {host!r}; pick "
            f"another --name or wait {conn.ttl(key)}s for it to expire"
        )
    if pid and pid != os.getpid() and alive(pid):
        raise RuntimeError(f"worker name {name!r} is in use by live process {pid}")


def rq_birth(conn: Redis, name: str, queues: list[str], ttl: int) -> None:
    """Write RQ's record of this worker (``rq info``, rq-dashboard) and join RQ's worker sets."""
    key, born = keys.rq_worker_key(name), rq_time()
    with conn.pipeline() as pipe:
        pipe.delete(key)
        pipe.hset(
            key,
            mapping={
                "birth": born,
                "last_heartbeat": born,
                "queues": ",".join(queues),
                "pid": os.getpid(),
                "hostname": socket.gethostname(),
                "ip_address": "",
                "version": _version(),
                "python_version": sys.version,
                "state": "idle",
                "successful_job_count": 0,
                "failed_job_count": 0,
                "total_working_time": 0,
            },
        )
        pipe.sadd(keys.RQ_WORKERS, key)
        for q in queues:
            pipe.sadd(keys.rq_queue_workers_key(q), key)
        pipe.expire(key, ttl)
        pipe.execute()


def rq_death(conn: Redis, name: str, queues: list[str]) -> None:
    """Mark RQ's record of this worker dead (it expires in a minute) and leave RQ's sets."""
    key = keys.rq_worker_key(name)
    with conn.pipeline() as pipe:
        pipe.srem(keys.RQ_WORKERS, key)
        for q in queues:
            pipe.srem(keys.rq_queue_workers_key(q), key)
        pipe.hset(key, mapping={"death": rq_time(), "state": "dead"})
        pipe.expire(key, 60)
        pipe.execute()


def _version() -> str:
    try:
        return f"mlxq {version('mlxq')}"
    except PackageNotFoundError:
        return "mlxq"
