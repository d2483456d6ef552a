"""Enqueueing validated requests as RQ jobs: JSON payloads, pipelined, idempotent per batch."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from redis import Redis
from rq import Queue
from rq.serializers import JSONSerializer

from schemas import ChatRequest, keys

DEFAULT_JOB_TIMEOUT = 3600
DEFAULT_CHUNK = 1000
#: The first chunk's size; each next one doubles, up to the chunk size, so
#: workers start on the first jobs while the rest are still being enqueued.
FIRST_CHUNK = 32


@dataclass(frozen=True)
class SubmitItem:
    """One request to submit, with the id the caller knows it by.

    ``body`` is the request's JSON form as read from a file (already validated
    into ``request``); when given it is stored as is, which saves re-serialising.
    """

    custom_id: str
    request: ChatRequest
    body: dict[str, Any] | None = None


@dataclass(frozen=True)
class SubmitSummary:
    batch_id: str
    queue: str
    submitted: int
    already_present: int
    job_ids: list[str]

    def as_dict(self) -> dict[str, object]:
        return {
            "batch_id": self.batch_id,
            "queue": self.queue,
            "submitted": self.submitted,
            "already_present": self.already_present,
            "jobs": len(self.job_ids),
        }


def new_batch_id() -> str:
    """A fresh batch id (``batch_`` and 20 hex digits)."""
    return f"batch_{uuid.uuid4().hex[:20]}"


def _register_batch(
    conn: Redis, batch_id: str, queue: str, result_ttl: int, source: str | None
) -> bool:
    """Create or refresh the batch record; True if the batch is new."""
    now = time.time()
    pipe = conn.pipeline()
    key = keys.batch_key(batch_id)
    pipe.hsetnx(key, "created_at", now)
    pipe.hset(key, mapping={"batch_id": batch_id, "queue": queue, "result_ttl": result_ttl})
    pipe.hsetnx(key, "total", 0)
    if source:
        pipe.hsetnx(key, "source", source)
    pipe.expire(key, result_ttl)
    pipe.zadd(keys.BATCHES, {batch_id: now}, nx=True)
    return bool(pipe.execute()[0])


def _known_job_ids(conn: Redis, batch_id: str) -> set[str]:
    """Job ids the batch already has (its job list is written with each enqueue, atomically)."""
    return {j.decode() for j in conn.lrange(keys.batch_jobs_key(batch_id), 0, -1)}


def submit_items(
    conn: Redis,
    items: Sequence[SubmitItem],
    *,
    batch_id: str | None = None,
    queue: str = keys.DEFAULT_QUEUE,
    job_timeout: int = DEFAULT_JOB_TIMEOUT,
    result_ttl: int = keys.DEFAULT_RESULT_TTL,
    source: str | None = None,
    chunk_size: int = DEFAULT_CHUNK,
    progress: Callable[[int], None] | None = None,
    route: str = "queue",
) -> SubmitSummary:
    """Enqueue ``items`` as one batch; jobs the batch already has (same custom_id) are skipped.

    ``route="model"`` puts each job on its model's queue
    (:func:`schemas.keys.queue_for_model`), which workers started with
    ``--model`` serve; ``"queue"`` puts every job on ``queue``.

    Chunks grow from ``FIRST_CHUNK`` items to ``chunk_size`` (workers start on
    the first jobs at once). Each chunk goes in one MULTI/EXEC transaction
    together with the batch's job list and counter, so an interruption never
    leaves a job the batch does not know about, and the job list tells exactly
    what is in: rerunning with the same ``batch_id`` enqueues only what is
    missing. Duplicate custom_ids within ``items`` are enqueued once.
    """
    batch_id = keys.validate_batch_id(batch_id or new_batch_id())
    is_new = _register_batch(conn, batch_id, queue, result_ttl, source)
    known = set() if is_new else _known_job_ids(conn, batch_id)
    if route not in ("queue", "model"):
        raise ValueError(f"route must be 'queue' or 'model', not {route!r}")
    rq_queues: dict[str, Queue] = {}
    submitted = present = 0
    job_ids: list[str] = []
    now = time.time()
    for start, stop in _chunks(len(items), chunk_size):
        chunk = items[start:stop]
        ids = [keys.job_id_for(batch_id, item.custom_id) for item in chunk]
        job_ids.extend(ids)
        fresh = []
        for job_id, item in zip(ids, chunk, strict=True):
            if job_id not in known:
                known.add(job_id)
                fresh.append((job_id, item))
        present += len(chunk) - len(fresh)
        if fresh:
            by_queue: dict[str, list] = {}
            for job_id, item in fresh:
                name = keys.queue_for_model(item.request.model) if route == "model" else queue
                by_queue.setdefault(name, []).append(
                    Queue.prepare_data(
                        keys.JOB_FUNCTION,
                        args=(_envelope(job_id, batch_id, item, now, result_ttl),),
                        job_id=job_id,
                        timeout=job_timeout,
                        result_ttl=result_ttl,
                        failure_ttl=result_ttl,
                        description=f"{batch_id} {item.custom_id}",
                    )
                )
            pipe = conn.pipeline(transaction=True)
            for name, datas in by_queue.items():
                if name not in rq_queues:
                    rq_queues[name] = Queue(name, connection=conn, serializer=JSONSerializer)
                rq_queues[name].enqueue_many(datas, pipeline=pipe)
            pipe.sadd(keys.batch_queues_key(batch_id), *by_queue)
            pipe.expire(keys.batch_queues_key(batch_id), result_ttl)
            pipe.rpush(keys.batch_jobs_key(batch_id), *[job_id for job_id, _ in fresh])
            pipe.expire(keys.batch_jobs_key(batch_id), result_ttl)
            pipe.hincrby(keys.batch_key(batch_id), "total", len(fresh))
            pipe.execute()
            submitted += len(fresh)
        if progress:
            progress(len(chunk))
    return SubmitSummary(batch_id, queue, submitted, present, job_ids)


def _chunks(n: int, size: int) -> list[tuple[int, int]]:
    """(start, stop) of each chunk: FIRST_CHUNK items, then twice as many each time, up to
    ``size``."""
    bounds, start, step = [], 0, min(FIRST_CHUNK, size)
    while start < n:
        bounds.append((start, min(n, start + step)))
        start += step
        step = min(size, step * 2)
    return bounds


def _envelope(
    job_id: str, batch_id: str, item: SubmitItem, now: float, result_ttl: int
) -> dict[str, object]:
    request = (
        item.body
        if item.body is not None
        else item.request.model_dump(mode="json", exclude_unset=True)
    )
    return {
        "job_id": job_id,
        "batch_id": batch_id,
        "custom_id": item.custom_id,
        "submitted_at": now,
        "result_ttl": result_ttl,
        "request": request,
    }
