"""Enqueueing validated requests as RQ jobs: JSON payloads, pipelined, idempotent per batch."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from redis import Redis
from rq import Queue
from rq.serializers import JSONSerializer

from schemas import ChatRequest, JobEnvelope, keys

DEFAULT_JOB_TIMEOUT = 3600
DEFAULT_CHUNK = 1000


@dataclass(frozen=True)
class SubmitItem:
    """One request to submit, with the id the caller knows it by."""

    custom_id: str
    request: ChatRequest


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
) -> None:
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
    pipe.execute()


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
) -> SubmitSummary:
    """Enqueue ``items`` as one batch; jobs already in Redis (same batch and custom_id) are skipped.

    Each chunk goes in one MULTI/EXEC transaction together with the batch's job
    list and counter, so an interruption never leaves a job the batch does not
    know about; rerunning with the same ``batch_id`` completes what is missing.
    """
    batch_id = keys.validate_batch_id(batch_id or new_batch_id())
    _register_batch(conn, batch_id, queue, result_ttl, source)
    rq_queue = Queue(queue, connection=conn, serializer=JSONSerializer)
    submitted = present = 0
    job_ids: list[str] = []
    now = time.time()
    for start in range(0, len(items), chunk_size):
        chunk = items[start : start + chunk_size]
        ids = [keys.job_id_for(batch_id, item.custom_id) for item in chunk]
        job_ids.extend(ids)
        check = conn.pipeline(transaction=False)
        for job_id in ids:
            check.exists(keys.rq_job_key(job_id), keys.result_key(job_id))
        exists = check.execute()
        fresh = [(i, item) for i, item, e in zip(ids, chunk, exists, strict=True) if not e]
        present += len(chunk) - len(fresh)
        if fresh:
            datas = [
                Queue.prepare_data(
                    keys.JOB_FUNCTION,
                    args=(_envelope(job_id, batch_id, item, now, result_ttl),),
                    job_id=job_id,
                    timeout=job_timeout,
                    result_ttl=result_ttl,
                    failure_ttl=result_ttl,
                    description=f"{batch_id} {item.custom_id}",
                )
                for job_id, item in fresh
            ]
            pipe = conn.pipeline(transaction=True)
            rq_queue.enqueue_many(datas, pipeline=pipe)
            pipe.rpush(keys.batch_jobs_key(batch_id), *[job_id for job_id, _ in fresh])
            pipe.expire(keys.batch_jobs_key(batch_id), result_ttl)
            pipe.hincrby(keys.batch_key(batch_id), "total", len(fresh))
            pipe.execute()
            submitted += len(fresh)
        if progress:
            progress(len(chunk))
    return SubmitSummary(batch_id, queue, submitted, present, job_ids)


def _envelope(
    job_id: str, batch_id: str, item: SubmitItem, now: float, result_ttl: int
) -> dict[str, object]:
    envelope = JobEnvelope(
        job_id=job_id,
        batch_id=batch_id,
        custom_id=item.custom_id,
        submitted_at=now,
        result_ttl=result_ttl,
        request=item.request,
    )
    return envelope.model_dump(mode="json", exclude_unset=True)
