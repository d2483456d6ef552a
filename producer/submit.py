"""Submitting a batch: register it, then enqueue its jobs (JSON payloads, idempotent per batch)."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from redis import Redis

from producer.enqueue import DEFAULT_CHUNK, Enqueuer, KnownJobs, Prepared
from schemas import ChatRequest, InvalidRequestError, job_data, keys
from schemas.audio import stored_audio
from schemas.cancel import CANCELLED_AT
from schemas.embeddings import EmbeddingRequest
from schemas.images import stored_images

DEFAULT_JOB_TIMEOUT = 3600


@dataclass(frozen=True)
class SubmitItem:
    """One request to submit, with the id the caller knows it by.

    ``body`` is the request's JSON form as read from a file (already validated
    into ``request``); when given it is stored as is, which saves re-serialising.
    """

    custom_id: str
    request: ChatRequest | EmbeddingRequest
    body: dict[str, Any] | None = None
    #: A /v1/responses or /v1/completions request's shape (``schemas.shapes``): ``request``
    #: is the chat job it runs as, and its output line is translated back.
    shape: dict[str, Any] | None = None


@dataclass(frozen=True)
class SubmitSummary:
    batch_id: str
    queue: str
    submitted: int
    already_present: int
    #: The jobs' ids in submission order (empty when the caller did not keep them:
    #: a file submit of a million lines does not).
    job_ids: list[str]
    #: Chunks that fewer than ``wait_replicas`` replicas acknowledged in time.
    replica_shortfalls: int = 0

    def as_dict(self) -> dict[str, object]:
        return {
            "batch_id": self.batch_id,
            "queue": self.queue,
            "submitted": self.submitted,
            "already_present": self.already_present,
            "jobs": self.submitted + self.already_present,
            "replica_shortfalls": self.replica_shortfalls,
        }


class BatchCancelledError(InvalidRequestError):
    """The batch id names a cancelled batch: nothing more can be submitted to it."""

    code = "batch_cancelled"


def new_batch_id() -> str:
    """A fresh batch id (``batch_`` and 20 hex digits)."""
    return f"batch_{uuid.uuid4().hex[:20]}"


def register_batch(
    conn: Redis, batch_id: str, queue: str, result_ttl: int, source: str | None
) -> KnownJobs:
    """Create or refresh the batch record; the jobs it already has (none if it is new).

    Raises :class:`BatchCancelledError` for a cancelled batch (its workers would drop
    every job added to it).
    """
    key = keys.batch_key(batch_id)
    if conn.hexists(key, CANCELLED_AT):
        raise BatchCancelledError(f"batch {batch_id!r} was cancelled; submit to a new --batch-id")
    now = time.time()
    pipe = conn.pipeline()
    pipe.hsetnx(key, "created_at", now)
    pipe.hset(
        key,
        mapping={
            "batch_id": batch_id,
            "queue": queue,
            "tenant": keys.tenant_of(queue),
            "priority": keys.priority_of(queue),
            "result_ttl": result_ttl,
        },
    )
    pipe.hsetnx(key, "total", 0)
    if source:
        pipe.hsetnx(key, "source", source)
    pipe.expire(key, result_ttl)
    pipe.zadd(keys.BATCHES, {batch_id: now}, nx=True)
    pipe.zadd(keys.tenant_batches_key(keys.tenant_of(queue)), {batch_id: now}, nx=True)
    is_new = pipe.execute()[0]
    return KnownJobs() if is_new else KnownJobs.load(conn, batch_id)


def queue_of(route: str, queue: str, model: str) -> str:
    """The list a job of ``model`` goes to under ``route`` ('queue' or 'model'). ``queue``
    may name a tenant's list (``mlxq@team-a``, ``mlxq@team-a^2``,
    :func:`schemas.keys.tenant_queue`): model routing keeps the tenant and priority on
    the model's queue."""
    if route == "model":
        to = keys.queue_for_model(model)
        return keys.tenant_queue(to, keys.tenant_of(queue), keys.priority_of(queue))
    if route == "queue":
        return queue
    raise ValueError(f"route must be 'queue' or 'model', not {route!r}")


def submit_items(
    conn: Redis,
    items: Iterable[SubmitItem],
    *,
    batch_id: str | None = None,
    queue: str = keys.DEFAULT_QUEUE,
    job_timeout: int = DEFAULT_JOB_TIMEOUT,
    result_ttl: int = keys.DEFAULT_RESULT_TTL,
    source: str | None = None,
    chunk_size: int = DEFAULT_CHUNK,
    progress: Callable[[int], None] | None = None,
    route: str = "queue",
    wait_replicas: int = 0,
) -> SubmitSummary:
    """Enqueue ``items`` as one batch; jobs the batch already has (same custom_id) are skipped.

    ``route="model"`` puts each job on its model's queue
    (:func:`schemas.keys.queue_for_model`), which workers started with
    ``--model`` serve; ``"queue"`` puts every job on ``queue``.

    Chunks grow from 32 items to ``chunk_size`` (workers start on the first jobs
    at once); each is atomic with the batch's job list, so rerunning with the same
    ``batch_id`` enqueues only what is missing. Duplicate custom_ids within
    ``items`` are enqueued once.
    """
    batch_id = keys.validate_batch_id(batch_id or new_batch_id())
    return enqueue_batch(
        conn,
        _prepare(items, batch_id, queue, route, result_ttl),
        batch_id=batch_id,
        queue=queue,
        route=route,
        job_timeout=job_timeout,
        result_ttl=result_ttl,
        source=source,
        chunk_size=chunk_size,
        progress=progress,
        keep_ids=True,
        wait_replicas=wait_replicas,
    )


def enqueue_batch(
    conn: Redis,
    jobs: Iterable[Prepared],
    *,
    batch_id: str,
    queue: str,
    route: str,
    job_timeout: int,
    result_ttl: int,
    source: str | None,
    chunk_size: int,
    progress: Callable[[int], None] | None,
    keep_ids: bool = False,
    wait_replicas: int = 0,
) -> SubmitSummary:
    """Register the batch, then enqueue ``jobs`` (read lazily, one chunk in memory)."""
    queue_of(route, queue, "")  # a bad route fails before anything is written
    known = register_batch(conn, batch_id, queue, result_ttl, source)
    enqueuer = Enqueuer(
        conn,
        batch_id,
        result_ttl=result_ttl,
        job_timeout=job_timeout,
        known=known,
        chunk_size=chunk_size,
        keep_ids=keep_ids,
        progress=progress,
        wait_replicas=wait_replicas,
    )
    enqueuer.add_all(jobs)
    enqueuer.flush()
    ids = enqueuer.job_ids or []
    return SubmitSummary(
        batch_id, queue, enqueuer.submitted, enqueuer.present, ids, enqueuer.shortfalls
    )


def _prepare(
    items: Iterable[SubmitItem], batch_id: str, queue: str, route: str, result_ttl: int
) -> Iterator[Prepared]:
    now, seen = time.time(), set()
    for item in items:
        job_id = keys.job_id_for(batch_id, item.custom_id)
        if job_id in seen:
            continue
        seen.add(job_id)
        body = (
            item.body
            if item.body is not None
            else item.request.model_dump(mode="json", exclude_unset=True, by_alias=True)
        )
        body, images = stored_images(body)
        body, audio = stored_audio(body)  # a recording too: once, with the batch
        images = images | audio
        yield Prepared(
            job_id,
            queue_of(route, queue, item.request.model),
            job_data(item.custom_id, now, body, result_ttl),
            item.custom_id,
            json.dumps(item.shape) if item.shape is not None else None,
            images or None,
            item.request.model,
        )
