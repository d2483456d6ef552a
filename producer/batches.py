"""Reading a batch back: status counts, rate and ETA, results as OpenAI Batch output lines."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from redis import Redis
from rq.job import Job
from rq.serializers import JSONSerializer

from schemas import BatchOutputLine, CancelledError, InvalidRequestError, ResultRecord, keys
from schemas.store import read_results, write_result

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
    total = int(meta.get("total", 0))
    succeeded = int(meta.get("succeeded", 0))
    failed = int(meta.get("failed", 0))
    cancelled = int(meta.get("cancelled", 0))
    running = _running(conn, batch_id)
    done = succeeded + failed + cancelled
    running = min(running, max(total - done, 0))
    rate = eta = None
    first, last = meta.get("first_done_at"), meta.get("last_done_at")
    if first and last and done >= 2 and float(last) > float(first):
        rate = (done - 1) / (float(last) - float(first))
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
        eta_s=eta,
    )


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


def _custom_ids(conn: Redis, job_ids: list[str]) -> dict[str, str | None]:
    jobs = Job.fetch_many(job_ids, connection=conn, serializer=JSONSerializer)
    found: dict[str, str | None] = {}
    for job_id, job in zip(job_ids, jobs, strict=True):
        try:
            found[job_id] = job.args[0]["custom_id"] if job else None
        except Exception:  # a broken job hash must not stop the export
            found[job_id] = None
    return found


def iter_output_lines(conn: Redis, batch_id: str) -> Iterator[BatchOutputLine | str]:
    """OpenAI Batch output lines for finished jobs, in submission order.

    Jobs still queued or running are yielded as their job id (a ``str``) so
    callers can count or report them; jobs whose record and RQ job are both
    gone (expired) get an error line.
    """
    for page in batch_job_ids(conn, batch_id):
        records = read_results(conn, page)
        missing = [j for j, r in zip(page, records, strict=True) if r is None]
        custom = _custom_ids(conn, missing) if missing else {}
        for job_id, record in zip(page, records, strict=True):
            if record is not None:
                yield BatchOutputLine.from_record(record)
            elif custom.get(job_id) is not None:
                yield job_id
            else:
                yield BatchOutputLine.missing(job_id, "", "result expired or job lost")


# Atomically take a batch's job ids out of a queue (workers LMOVE from it concurrently).
_CANCEL = """
local items = redis.call('LRANGE', KEYS[1], 0, -1)
local keep, removed = {}, {}
local prefix = ARGV[1]
for _, id in ipairs(items) do
  local rest = string.sub(id, #prefix + 1)
  if string.sub(id, 1, #prefix) == prefix and #rest == 20 and string.match(rest, '^%x+$') then
    table.insert(removed, id)
  else
    table.insert(keep, id)
  end
end
if #removed > 0 then
  redis.call('DEL', KEYS[1])
  for i = 1, #keep, 5000 do
    redis.call('RPUSH', KEYS[1], unpack(keep, i, math.min(i + 4999, #keep)))
  end
end
return removed
"""


def cancel_batch(conn: Redis, batch_id: str) -> tuple[int, int]:
    """Remove the batch's queued jobs and give each a "cancelled" result.

    Running jobs finish normally. Returns (cancelled, still running).
    """
    status = batch_status(conn, batch_id)
    ttl = int(conn.hget(keys.batch_key(batch_id), "result_ttl") or keys.DEFAULT_RESULT_TTL)
    cancelled = 0
    for queue in batch_queues(conn, batch_id):
        removed = [
            j.decode() for j in conn.eval(_CANCEL, 1, keys.rq_queue_key(queue), f"{batch_id}-")
        ]
        custom = _custom_ids(conn, removed) if removed else {}
        error = CancelledError("cancelled before it started (producer cancel)")
        for job_id in removed:
            record = ResultRecord.failed(job_id, batch_id, custom.get(job_id) or "", error)
            write_result(conn, record, ttl)
            conn.hset(keys.rq_job_key(job_id), "status", "canceled")
            cancelled += 1
    return cancelled, status.running
