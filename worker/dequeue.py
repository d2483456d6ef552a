"""Dequeueing: every job id moves atomically into an intermediate list, with its job hash.

RQ's single-queue dequeue is an LMOVE into the queue's intermediate list (a
worker dying right after it loses nothing: recovery finds the id there), but
with several queues RQ uses a lossy BLPOP. ``MlxqQueue`` always moves, and
reads the job hash in the same round trip (one script: LMOVE then HGETALL).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from redis import Redis
from rq import Queue
from rq.exceptions import DequeueTimeout, NoSuchJobError, StopRequested
from rq.job import Job

from schemas import keys

if TYPE_CHECKING:
    from worker.rqworker import MlxqWorker

log = logging.getLogger(__name__)

# Atomically move the next id into the intermediate list and read its job hash.
_TAKE = """
local id = redis.call('LMOVE', KEYS[1], KEYS[2], 'LEFT', 'RIGHT')
if not id then return false end
return {id, redis.call('HGETALL', ARGV[1] .. id)}
"""

#: ``worker``: the MlxqWorker dequeuing in this thread (told before it blocks, and
#: asked whether a stop came while it was taking a job).
_dequeuing = threading.local()


def dead_letter(conn: Redis, job_id: str, reason: str) -> None:
    """Record a job that cannot run at all (no or corrupt job hash) on ``mlxq:dead``."""
    entry = json.dumps({"job_id": job_id, "reason": reason, "at": time.time()})
    pipe = conn.pipeline()
    pipe.lpush(keys.DEAD_LETTERS, entry)
    pipe.ltrim(keys.DEAD_LETTERS, 0, keys.DEAD_LETTERS_MAX - 1)
    pipe.execute()
    log.warning("dead-lettered job %s: %s", job_id, reason)


def hand_back(conn: Redis, queue: Queue, job_id: str) -> None:
    """Put a taken, unstarted job back at the front of its queue."""
    pipe = conn.pipeline()
    pipe.lrem(keys.rq_intermediate_key(queue.name), 1, job_id)
    pipe.lpush(queue.key, job_id)
    pipe.execute()


def take(connection: Redis, queue: Queue) -> tuple[str, dict[bytes, bytes] | None] | None:
    """LMOVE the queue's next id into its intermediate list and read its job hash, in one
    script: (id, job hash), or None if the queue is empty.

    Sent as EVAL: Redis caches the script by its hash all the same, and a
    restarted Redis needs no reload.
    """
    inter = keys.rq_intermediate_key(queue.name)
    taken = connection.eval(_TAKE, 2, queue.key, inter, keys.rq_job_key(""))
    if not taken:
        return None
    job_id = taken[0].decode()
    if ":" in job_id:  # RQ reads such an id as an execution key: let fetch parse it
        return job_id, None
    fields = taken[1]
    return job_id, dict(zip(fields[::2], fields[1::2], strict=True))


def job_from(
    job_cls: type[Job],
    job_id: str,
    data: dict[bytes, bytes] | None,
    connection: Redis,
    serializer: Any = None,
) -> Job:
    """The job from the hash :func:`take` read (fetched when it read none).

    Raises NoSuchJobError when the id has no job hash, anything else when the
    hash is corrupt.
    """
    if data is None:
        return job_cls.fetch(job_id, connection=connection, serializer=serializer)
    if not data:
        raise NoSuchJobError(job_id)
    job = job_cls(job_id, connection=connection, serializer=serializer)
    job.restore(data)
    return job


@contextmanager
def dequeuing(worker: MlxqWorker) -> Iterator[None]:
    """Mark ``worker`` as the one dequeuing in this thread."""
    _dequeuing.worker = worker
    try:
        yield
    finally:
        _dequeuing.worker = None


@contextmanager
def _taking(worker: MlxqWorker | None) -> Iterator[None]:
    """A non-blocking take in flight: a stop request waits for it (``MlxqWorker._shutdown``)."""
    if worker is None:
        yield
        return
    worker.taking = True
    try:
        yield
    finally:
        worker.taking = False


class MlxqQueue(Queue):
    """A queue whose multi-queue dequeue is as safe as RQ's single-queue one."""

    #: Seconds one blocking wait lasts when several queues are served.
    BLOCK_S = 1

    @classmethod
    def dequeue_any(  # type: ignore[override]
        cls,
        queues: Iterable[Queue],
        timeout: int | None,
        connection: Redis,
        job_class: type[Job] | None = None,
        serializer: Any = None,
        death_penalty_class: Any = None,
    ) -> tuple[Job, Queue] | None:
        queues = list(queues)
        job_cls = job_class or Job
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            taken = cls._take(queues, connection, deadline)
            if taken is None:
                return None
            queue, job_id, data = taken
            try:
                job = job_from(job_cls, job_id, data, connection, serializer)
            except NoSuchJobError:
                connection.lrem(keys.rq_intermediate_key(queue.name), 1, job_id)
                dead_letter(connection, job_id, f"queue {queue.name!r} held an id with no job hash")
                continue
            except Exception as e:
                connection.lrem(keys.rq_intermediate_key(queue.name), 1, job_id)
                connection.hset(keys.rq_job_key(job_id), "status", "failed")
                dead_letter(connection, job_id, f"corrupt job hash: {type(e).__name__}: {e}")
                continue
            return job, queue

    @classmethod
    def _take(
        cls, queues: list[Queue], connection: Redis, deadline: float | None
    ) -> tuple[Queue, str, dict[bytes, bytes] | None] | None:
        """Move the next job id (first queue first) into that queue's intermediate list.

        Also returns the job hash when it came in the same round trip (None when
        it did not). A dequeuing :class:`MlxqWorker` is told before the wait
        (``going_idle``), and a stop it was asked while taking ends the wait.
        """
        worker: MlxqWorker | None = getattr(_dequeuing, "worker", None)
        while True:
            for queue in queues:
                with _taking(worker):
                    found = take(connection, queue)
                if found is not None:
                    return queue, *found
            if worker is not None:
                worker.going_idle()
                if worker._stop_requested:
                    raise StopRequested()  # asked while taking: stop before waiting
            if deadline is None:
                return None
            left = deadline - time.monotonic()
            if left <= 0:
                raise DequeueTimeout(0, [q.key for q in queues])
            # One queue: block on it for the whole wait. Several: block briefly on
            # the first, then look at all of them again.
            wait = max(1, int(left)) if len(queues) == 1 else max(1, min(int(left), cls.BLOCK_S))
            src, dst = queues[0].key, keys.rq_intermediate_key(queues[0].name)
            raw = connection.blmove(src, dst, wait)
            if raw is not None:
                return queues[0], raw.decode(), None
