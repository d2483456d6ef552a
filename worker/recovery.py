"""Recovering jobs whose worker died, so every accepted job ends with exactly one result.

A running job holds a lease: its ``job_id:execution_id`` entry in RQ's started
registry is scored with an expiry that the worker's heartbeat thread keeps
pushing forward. When a worker dies (SIGKILL, power loss), the lease runs out
and any worker's recovery pass puts the job back at the front of its queue; a
job that has killed its worker ``max_crashes`` times is failed as poison with
a result record instead of looping forever. Jobs stranded between dequeue and
start (in RQ's intermediate list) are put back too. Removing the registry
entry (ZREM) is the claim: of several recovering workers exactly one acts.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from redis import Redis
from rq.job import Job
from rq.serializers import JSONSerializer

from schemas import ErrorInfo, MlxqError, ResultRecord, keys
from schemas.store import has_result, write_result

log = logging.getLogger(__name__)

#: How long a crash counter is kept.
CRASH_MEMORY_S = 7 * 24 * 3600


class PoisonJobError(MlxqError):
    """The job's worker died too many times while running it."""

    code = "poison_job"


@dataclass
class RecoveryReport:
    requeued: list[str] = field(default_factory=list)
    poisoned: list[str] = field(default_factory=list)
    already_done: list[str] = field(default_factory=list)
    unstuck: list[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.requeued or self.poisoned or self.already_done or self.unstuck)

    def extend(self, other: RecoveryReport) -> None:
        self.requeued += other.requeued
        self.poisoned += other.poisoned
        self.already_done += other.already_done
        self.unstuck += other.unstuck


def requeue(conn: Redis, queue: str, job_id: str) -> None:
    """Put a job back at the front of its queue (it has waited its turn already)."""
    pipe = conn.pipeline()
    pipe.hset(keys.rq_job_key(job_id), "status", "queued")
    pipe.lpush(keys.rq_queue_key(queue), job_id)
    pipe.execute()


def _custom_id(conn: Redis, job_id: str) -> tuple[str, int]:
    """The job's custom_id and result TTL, read from its JSON payload when possible."""
    try:
        envelope = Job.fetch(job_id, connection=conn, serializer=JSONSerializer).args[0]
        return str(envelope["custom_id"]), int(envelope.get("result_ttl", keys.DEFAULT_RESULT_TTL))
    except Exception:  # a missing or broken job hash must not stop the recovery pass
        return "", keys.DEFAULT_RESULT_TTL


def fail_job(conn: Redis, job_id: str, error: MlxqError, worker_id: str) -> bool:
    """Write a failed result record for a job that will not run again; mark it failed in RQ."""
    custom_id, ttl = _custom_id(conn, job_id)
    record = ResultRecord(
        job_id=job_id,
        batch_id=keys.batch_of(job_id),
        custom_id=custom_id,
        status="failed",
        status_code=error.status_code,
        error=ErrorInfo(message=str(error), type=error.type, code=error.code),
        finished_at=time.time(),
    )
    written = write_result(conn, record, ttl)
    conn.hset(keys.rq_job_key(job_id), "status", "failed")
    log.warning("%s: job %s failed: %s", worker_id, job_id, error)
    return written


def _abandoned(
    conn: Redis, queue: str, job_id: str, max_crashes: int, worker_id: str, report: RecoveryReport
) -> None:
    if not conn.exists(keys.rq_job_key(job_id)):
        return
    if has_result(conn, job_id):
        # It finished; only RQ's bookkeeping was lost with the worker.
        conn.hset(keys.rq_job_key(job_id), "status", "finished")
        report.already_done.append(job_id)
        return
    crashes = conn.incr(keys.crashes_key(job_id))
    conn.expire(keys.crashes_key(job_id), CRASH_MEMORY_S)
    if crashes >= max_crashes:
        fail_job(
            conn,
            job_id,
            PoisonJobError(
                f"the worker running this job died {crashes} times (lease expired each time); "
                "not retried again"
            ),
            worker_id,
        )
        report.poisoned.append(job_id)
        return
    requeue(conn, queue, job_id)
    report.requeued.append(job_id)
    log.warning(
        "%s: job %s lost its worker (crash %d of %d allowed); requeued",
        worker_id,
        job_id,
        crashes,
        max_crashes - 1,
    )


def recover_queue(
    conn: Redis,
    queue: str,
    *,
    max_crashes: int = 3,
    stuck_grace_s: float = 30.0,
    worker_id: str = "",
    now: float | None = None,
) -> RecoveryReport:
    """Requeue (or poison) the queue's jobs whose lease expired, and unstick stranded ones."""
    now = time.time() if now is None else now
    report = RecoveryReport()
    started = keys.rq_started_key(queue)
    for member in conn.zrangebyscore(started, "-inf", now):
        if conn.zrem(started, member):  # the claim: only one recovering worker wins it
            job_id = member.decode().split(":", 1)[0]
            _abandoned(conn, queue, job_id, max_crashes, worker_id, report)
    running = {m.decode().split(":", 1)[0] for m in conn.zrange(started, 0, -1)}
    intermediate = keys.rq_intermediate_key(queue)
    for raw in conn.lrange(intermediate, 0, -1):
        job_id = raw.decode()
        if job_id in running:
            continue
        seen_key = keys.stuck_key(queue, job_id)
        if conn.set(seen_key, now, nx=True, ex=3600):
            continue  # first sighting: a worker may be between dequeue and start right now
        if now - float(conn.get(seen_key) or now) < stuck_grace_s:
            continue
        if conn.lrem(intermediate, 1, job_id):
            conn.delete(seen_key)
            if has_result(conn, job_id):
                report.already_done.append(job_id)
                continue
            requeue(conn, queue, job_id)
            report.unstuck.append(job_id)
            log.warning("%s: job %s was stranded after dequeue; requeued", worker_id, job_id)
    return report


def expire_leases_of_worker(conn: Redis, queue: str, worker_name: str) -> list[str]:
    """End at once the leases held by ``worker_name`` (known dead). Returns their job ids."""
    started = keys.rq_started_key(queue)
    ended = []
    for member in conn.zrange(started, 0, -1):
        composite = member.decode()
        owner = conn.hget(keys.rq_execution_key(composite), "worker_name")
        if owner is not None and owner.decode() == worker_name:
            conn.zadd(started, {member: 0}, xx=True)
            ended.append(composite.split(":", 1)[0])
    return ended
