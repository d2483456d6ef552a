"""Reading a batch back: status counts, rate and ETA, results as OpenAI Batch output lines."""

from __future__ import annotations

import json
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from redis import Redis

from schemas import BatchOutputLine, CancelledError, InvalidRequestError, ResultRecord, keys
from schemas.cancel import CANCELLED_AT
from schemas.scripts import source
from schemas.shapes import render

PAGE = 1000


class BatchNotFoundError(InvalidRequestError):
    """No batch of that id in this Redis."""

    code = "batch_not_found"


@dataclass(frozen=True)
class BatchStatus:
    batch_id: str
    total: int
    queued: int
    running: int
    succeeded: int
    failed: int
    created_at: float
    rate_per_s: float | None
    eta_s: float | None
    cancelled: int = 0
    #: When ``producer cancel`` stopped the batch (None: not cancelled).
    cancelled_at: float | None = None

    @property
    def done(self) -> int:
        return self.succeeded + self.failed + self.cancelled

    @property
    def finished(self) -> bool:
        return self.done >= self.total

    def as_dict(self) -> dict[str, object]:
        return {
            "batch_id": self.batch_id,
            "total": self.total,
            "queued": self.queued,
            "running": self.running,
            "succeeded": self.succeeded,
            "failed": self.failed,
            "cancelled": self.cancelled,
            "done": self.done,
            "rate_per_s": self.rate_per_s,
            "eta_s": self.eta_s,
            "cancelled_at": self.cancelled_at,
        }


def _running(conn: Redis, batch_id: str) -> int:
    """Jobs of the batch some worker holds right now (``mlxq:running``)."""
    prefix = f"{batch_id}-".encode()
    return sum(1 for job_id in conn.hkeys(keys.RUNNING) if job_id.startswith(prefix))


def batch_queues(conn: Redis, batch_id: str, meta: dict[str, str] | None = None) -> list[str]:
    """The queues the batch's jobs were put on."""
    queues = sorted(q.decode() for q in conn.smembers(keys.batch_queues_key(batch_id)))
    if not queues and meta and meta.get("queue"):
        queues = [meta["queue"]]
    return queues


def queue_watchers(conn: Redis, queues: list[str]) -> dict[str, int]:
    """How many live workers listen on each queue (from RQ's worker registry)."""
    from rq import Queue, Worker

    return {q: Worker.count(queue=Queue(q, connection=conn)) for q in queues}


def batch_status(conn: Redis, batch_id: str) -> BatchStatus:
    """Counts for a batch; raises :class:`BatchNotFoundError` if Redis has no such batch."""
    meta = {k.decode(): v.decode() for k, v in conn.hgetall(keys.batch_key(batch_id)).items()}
    if not meta:
        raise BatchNotFoundError(
            f"no batch {batch_id!r} in this Redis (expired or never submitted)"
        )
    return status_of(batch_id, meta, _running(conn, batch_id), began=_began(conn, batch_id))


def _began(conn: Redis, batch_id: str) -> float | None:
    """When the batch's work began: its first finished job's start (that job's
    ``finished_at`` less its run time). None before any job has ended."""
    first = conn.lindex(keys.batch_done_key(batch_id), 0)
    raw = conn.get(keys.result_key(first.decode())) if first else None
    if raw is None:
        return None
    record = ResultRecord.model_validate_json(raw)
    run_s = record.metrics.total_time_s if record.metrics is not None else 0.0
    return record.finished_at - (run_s or 0.0)


def status_of(
    batch_id: str,
    meta: dict[str, str],
    running: int,
    began: float | None = None,
    now: float | None = None,
) -> BatchStatus:
    """A batch's counts from its hash (``mlxq:batch:<id>``) and its jobs held now.

    The rate is jobs ended over the wall time since the work ``began`` (to the last end
    once all have ended, else to ``now``): a burst of jobs ending together does not
    read as thousands of jobs/s, and a batch nobody works on slows down as it waits."""
    total = int(meta.get("total", 0))
    succeeded = int(meta.get("succeeded", 0))
    failed = int(meta.get("failed", 0))
    cancelled = int(meta.get("cancelled", 0))
    done = succeeded + failed + cancelled
    running = min(running, max(total - done, 0))
    cancelled_at = float(meta[CANCELLED_AT]) if meta.get(CANCELLED_AT) else None
    if cancelled_at is not None:  # every job not ended and not running will never run
        cancelled += max(total - done - running, 0)
        done = succeeded + failed + cancelled
    rate = eta = None
    first, last = meta.get("first_done_at"), meta.get("last_done_at")
    start = began if began is not None else float(first) if first else None
    if start is not None and last and done >= 1:
        end = float(last) if done >= total else (time.time() if now is None else now)
        if end > start:
            rate = done / (end - start)
            eta = (total - done) / rate
    return BatchStatus(
        batch_id=batch_id,
        total=total,
        queued=max(total - done - running, 0),
        running=running,
        succeeded=succeeded,
        failed=failed,
        cancelled=cancelled,
        created_at=float(meta.get("created_at", 0.0)),
        rate_per_s=rate,
        eta_s=None if cancelled_at is not None else eta,
        cancelled_at=cancelled_at,
    )


class RateWindow:
    """Jobs/s over the last ``span`` seconds of (time, jobs ended) samples: what ``--watch``
    shows once it has watched ``least`` seconds (the rate of now, not of the whole batch)."""

    def __init__(self, span: float = 60.0, least: float = 10.0) -> None:
        self.span, self.least = span, least
        self.samples: deque[tuple[float, int]] = deque()

    def add(self, t: float, done: int) -> float | None:
        self.samples.append((t, done))
        while len(self.samples) > 2 and t - self.samples[1][0] >= self.span:
            self.samples.popleft()
        t0, d0 = self.samples[0]
        return (done - d0) / (t - t0) if t - t0 >= self.least else None


def wait_for_batch(
    conn: Redis,
    batch_id: str,
    *,
    timeout: float | None = None,
    poll_s: float = 0.5,
    on_progress: Callable[[BatchStatus], None] | None = None,
) -> BatchStatus:
    """Block until every job of the batch has a result (or ``timeout`` seconds pass)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        status = batch_status(conn, batch_id)
        if on_progress:
            on_progress(status)
        if status.finished:
            return status
        if deadline is not None and time.monotonic() >= deadline:
            raise TimeoutError(
                f"batch {batch_id}: {status.done}/{status.total} done after {timeout}s"
            )
        time.sleep(poll_s)


def batch_job_ids(conn: Redis, batch_id: str) -> Iterator[list[str]]:
    """The batch's job ids, a page at a time, in submission order."""
    key = keys.batch_jobs_key(batch_id)
    start = 0
    while True:
        page = [j.decode() for j in conn.lrange(key, start, start + PAGE - 1)]
        if not page:
            return
        yield page
        start += len(page)


CANCELLED_MESSAGE = "cancelled before it started (producer cancel)"


def page_outcomes(
    conn: Redis, batch_id: str, page: list[str], cancelled: bool
) -> list[ResultRecord | str | None]:
    """Per job of ``page``: its record; a ``cancelled`` record if the batch is
    ``cancelled`` and the job never started; its id (a ``str``) while it is queued
    or running; None if its record and its job are gone (expired). Two round trips
    per page, whatever its size.

    Which jobs are running is read before the records: a job that ends in between
    has its record by then, so it is never taken for a cancelled one.
    """
    with conn.pipeline(transaction=False) as pipe:
        pipe.hmget(keys.RUNNING, page)
        pipe.mget([keys.result_key(j) for j in page])
        running, raws = pipe.execute()
    missing = [j for j, raw in zip(page, raws, strict=True) if raw is None]
    jobs: dict[str, list[bytes | None]] = {}
    if missing:
        with conn.pipeline(transaction=False) as pipe:
            for job_id in missing:
                pipe.hmget(keys.rq_job_key(job_id), "status", "description")
            jobs = dict(zip(missing, pipe.execute(), strict=True))
    out: list[ResultRecord | str | None] = []
    for job_id, held, raw in zip(page, running, raws, strict=True):
        if raw is not None:
            out.append(ResultRecord.model_validate_json(raw))
            continue
        status, custom_id = jobs[job_id]
        if held is None and (cancelled or status == b"canceled"):
            cid = custom_id.decode() if custom_id else ""
            error = CancelledError(CANCELLED_MESSAGE)
            out.append(ResultRecord.failed(job_id, batch_id, cid, error))
        else:
            out.append(job_id if held is not None or status is not None else None)
    return out


def is_cancelled(conn: Redis, batch_id: str) -> bool:
    """Whether ``producer cancel`` stopped the batch."""
    return bool(conn.hexists(keys.batch_key(batch_id), CANCELLED_AT))


def iter_output_lines(conn: Redis, batch_id: str) -> Iterator[BatchOutputLine | str]:
    """OpenAI Batch output lines for finished jobs, in submission order.

    Jobs still queued or running are yielded as their job id (a ``str``) so
    callers can count or report them; jobs of a cancelled batch that never
    started get a ``cancelled`` line; jobs whose record and RQ job are both gone
    (expired) get an error line.
    """
    cancelled = is_cancelled(conn, batch_id)
    shaped = bool(conn.exists(keys.batch_shapes_key(batch_id)))
    for page in batch_job_ids(conn, batch_id):
        outcomes = page_outcomes(conn, batch_id, page, cancelled)
        shapes = conn.hmget(keys.batch_shapes_key(batch_id), page) if shaped else []
        for i, (job_id, outcome) in enumerate(zip(page, outcomes, strict=True)):
            if isinstance(outcome, ResultRecord):
                line = BatchOutputLine.from_record(outcome)
                yield reshaped(line, shapes[i]) if shaped and shapes[i] else line
            elif outcome is None:
                yield BatchOutputLine.missing(job_id, "", "result expired or job lost")
            else:
                yield outcome


def reshaped(line: BatchOutputLine, shape: bytes) -> BatchOutputLine:
    """A /v1/responses or /v1/completions line's output: its job's chat.completion
    translated back (``schemas.shapes``; mlxq's metrics kept). Errors stay as they are."""
    response = line.response
    if response is None or response.status_code != 200:
        return line
    completion = dict(response.body)
    metrics = completion.pop("mlxq_metrics", None)
    body = render(json.loads(shape), completion) | {"mlxq_metrics": metrics}
    return line.model_copy(update={"response": response.model_copy(update={"body": body})})


#: Lua (``schemas/lua/cancel_sweep.lua``): drop the cancelled batch's ids at the head
#: of a queue, a bounded number per call.
_SWEEP = source("cancel_sweep")

#: Ids the cancel sweep drops per script call (a few ms of Redis time).
SWEEP_STEP = 2000


def cancel_batch(
    conn: Redis, batch_id: str, event: str | None = "batch.cancelled"
) -> tuple[int, int]:
    """Cancel the batch: none of its queued jobs will start; running ones stop at their
    next step (a ``cancelled`` record with the text they made, ``worker.runner.stops``).

    One flag on the batch record does it (workers check it when they take a job, and
    between the steps of the jobs they run),
    so this takes the same time for ten jobs or a million. Then the batch's jobs
    at the head of each of its queues are dropped in bounded steps (a queue no
    worker serves is cleaned too); the rest are dropped by the workers that reach
    them. Returns (jobs cancelled, jobs still running).
    """
    status = batch_status(conn, batch_id)
    if conn.hsetnx(keys.batch_key(batch_id), CANCELLED_AT, repr(time.time())) and event:
        from producer.webhooks import emit  # its tenant's webhook, if it has one

        emit(conn, batch_id, event)
    sweep = conn.register_script(_SWEEP)
    for queue in batch_queues(conn, batch_id):
        args = [keys.rq_job_key(""), f"{batch_id}-", SWEEP_STEP]
        while sweep(keys=[keys.rq_queue_key(queue), keys.batch_key(batch_id)], args=args):
            pass
    after = batch_status(conn, batch_id)
    return after.cancelled - status.cancelled, after.running
