"""Putting prepared jobs into Redis: one script call per chunk, idempotent per batch.

A job is an RQ job hash (``data``, ``status``, ``origin``, ``enqueued_at``,
``timeout`` and ``description``, which holds the custom_id: the fields RQ's tools
read, none of RQ's empty ones) and its id on an RQ queue list. Each chunk goes in
with one Lua script, atomically with the batch's job list and counter, so an
interruption never leaves a job the batch does not know about, and the job list
tells exactly what is in. A script holds Redis for the time of one chunk (about
3 ms per 1,000 jobs here), never longer.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from redis import Redis

from schemas import keys
from schemas.connect import WAIT_TIMEOUT_MS, wait_for_replicas
from schemas.scripts import source

log = logging.getLogger(__name__)

#: The first chunk's size; each next one doubles up to the chunk size, so
#: workers start on the first jobs while the rest are still being enqueued.
FIRST_CHUNK = 32
DEFAULT_CHUNK = 1000
#: Job ids read per LRANGE when loading a batch's known jobs.
PAGE = 10_000

#: Lua (``schemas/lua/enqueue.lua``): a chunk of a batch's jobs, written and queued
#: at once (its keys and arguments are at the top of the file).
ENQUEUE_LUA = source("enqueue")


def digest_of(job_id: str) -> bytes:
    """The 20 hex digits that make a job id unique within its batch."""
    return job_id[-20:].encode()


@dataclass
class KnownJobs:
    """The digests of the jobs a batch already has, sorted (20 bytes each, not Python objects:
    a million known jobs take 20 MB)."""

    digests: np.ndarray = field(default_factory=lambda: np.empty(0, dtype="S20"))

    @classmethod
    def load(cls, conn: Redis, batch_id: str) -> KnownJobs:
        key = keys.batch_jobs_key(batch_id)
        pages, start = [], 0
        while page := conn.lrange(key, start, start + PAGE - 1):
            pages.append(np.array([j[-20:] for j in page], dtype="S20"))
            start += len(page)
        return cls(np.sort(np.concatenate(pages)) if pages else np.empty(0, dtype="S20"))

    def contains(self, digests: list[bytes]) -> np.ndarray:
        """A bool per digest: whether the batch has it."""
        if not len(self.digests) or not digests:
            return np.zeros(len(digests), dtype=bool)
        wanted = np.array(digests, dtype="S20")
        at = np.minimum(np.searchsorted(self.digests, wanted), len(self.digests) - 1)
        return self.digests[at] == wanted


@dataclass(frozen=True)
class Prepared:
    """A job ready to enqueue: its id, the queue it goes to, its hash's ``data``, its
    custom_id, the shape of a /v1/responses or /v1/completions line (JSON,
    ``schemas.shapes``: kept beside the batch for its output line), its images and the
    model it names (its hash's ``model``: workers take jobs of models they hold first)."""

    job_id: str
    queue: str
    data: bytes
    custom_id: str
    shape: str | None = None
    images: dict[str, bytes] | None = None  # its images by SHA-256, stored once per batch
    model: str = ""  # the model it names: on its hash, for model-affine takes


def enqueue_call(
    batch_id: str,
    jobs: list[Prepared],
    result_ttl: int,
    job_timeout: int,
    most: int = 0,
    notify: str = "",
    turns: bool = False,
) -> tuple[list[str], list[object]]:
    """The keys and arguments of :data:`ENQUEUE_LUA` for ``jobs`` of ``batch_id``; with
    ``most`` > 0 the script writes nothing (-1) while that many jobs wait on the queue;
    ``notify``: the list record writers announce the batch's ended jobs on; ``turns``:
    the batch takes turns with its tenant's other batches (on its own list when its
    queue's list already holds work)."""
    queues: dict[str, int] = {}
    per_job: list[object] = []
    for j in jobs:
        per_job += (
            j.job_id,
            queues.setdefault(j.queue, len(queues) + 1),
            j.data,
            j.custom_id,
            j.model,
        )
    script_keys = [
        keys.batch_jobs_key(batch_id),
        keys.batch_key(batch_id),
        keys.batch_queues_key(batch_id),
        keys.RQ_QUEUES,
    ]
    args = [keys.rq_job_key(""), keys.rq_queue_key(""), result_ttl, keys.rq_time(), job_timeout]
    own = batch_id if turns else ""
    return script_keys, [*args, len(queues), *queues, *per_job, own, most, notify]


class Enqueuer:
    """Enqueue prepared jobs of one batch in growing chunks, skipping those it already has."""

    def __init__(
        self,
        conn: Redis,
        batch_id: str,
        *,
        result_ttl: int,
        job_timeout: int,
        known: KnownJobs,
        chunk_size: int = DEFAULT_CHUNK,
        keep_ids: bool = False,
        progress: Callable[[int], None] | None = None,
        wait_replicas: int = 0,
    ) -> None:
        self.conn, self.batch_id = conn, batch_id
        # After each chunk: WAIT for this many replicas to have it (0: do not wait).
        self.wait_replicas = wait_replicas
        self.shortfalls = 0  # chunks fewer replicas acknowledged within WAIT_TIMEOUT_MS
        self.result_ttl, self.job_timeout = result_ttl, job_timeout
        self.known, self.chunk_size = known, chunk_size
        self.progress = progress
        self.job_ids: list[str] | None = [] if keep_ids else None
        self.submitted = self.present = 0
        self._script = conn.register_script(ENQUEUE_LUA)
        self._pending: list[Prepared] = []
        self._limit = min(FIRST_CHUNK, chunk_size)
        self._images: set[str] = set()  # digests stored by this submit

    def add(self, job: Prepared) -> None:
        self._pending.append(job)
        if len(self._pending) >= self._limit:
            self.flush()

    def add_all(self, jobs: Iterator[Prepared]) -> None:
        for job in jobs:
            self.add(job)

    def _enqueue_and_wait(self, script_keys: list[str], args: list[Any]) -> None:
        with self.conn.pipeline(transaction=False) as pipe:
            self._script(keys=script_keys, args=args, client=pipe)
            wait_for_replicas(pipe, self.wait_replicas)
            acked = pipe.execute()[-1]
        if int(acked) < self.wait_replicas:
            self.shortfalls += 1
            log.warning(
                "batch %s: a chunk reached %d of %d replica(s) within %d ms (it may be lost "
                "if the primary fails now; submit again with --batch-id %s to make sure)",
                self.batch_id,
                int(acked),
                self.wait_replicas,
                WAIT_TIMEOUT_MS,
                self.batch_id,
            )

    def _store_images(self, fresh: list[Prepared]) -> None:
        """Before the jobs that show them: each image of the batch once (``schemas.images``)."""
        new = {
            d: b for j in fresh if j.images for d, b in j.images.items() if d not in self._images
        }
        if not new:
            return
        key = keys.batch_images_key(self.batch_id)
        with self.conn.pipeline(transaction=False) as pipe:
            for digest, data in new.items():  # one image per command: replies stay small
                pipe.hsetnx(key, digest, data)
            pipe.expire(key, self.result_ttl)
            pipe.execute()
        self._images.update(new)

    def flush(self) -> None:
        chunk, self._pending = self._pending, []
        if not chunk:
            return
        self._limit = min(self.chunk_size, self._limit * 2)
        if self.job_ids is not None:
            self.job_ids.extend(j.job_id for j in chunk)
        have = self.known.contains([digest_of(j.job_id) for j in chunk])
        fresh = [j for j, h in zip(chunk, have, strict=True) if not h]
        self.present += len(chunk) - len(fresh)
        self._store_images(fresh)
        shapes = {j.job_id: j.shape for j in fresh if j.shape is not None}
        if shapes:  # before the jobs: a job never ends without its shape in place
            key = keys.batch_shapes_key(self.batch_id)
            with self.conn.pipeline(transaction=False) as pipe:
                pipe.hset(key, mapping=shapes)
                pipe.expire(key, self.result_ttl)
                pipe.execute()
        if fresh:
            script_keys, args = enqueue_call(
                self.batch_id, fresh, self.result_ttl, self.job_timeout, turns=True
            )
            if self.wait_replicas:
                self._enqueue_and_wait(script_keys, args)
            else:
                self._script(keys=script_keys, args=args)
            self.submitted += len(fresh)
        if self.progress:
            self.progress(len(chunk))
