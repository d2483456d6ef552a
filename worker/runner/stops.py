"""Running jobs that must stop, and why: one rule for every path a job runs on.

A job stops mid-way when its batch is cancelled (``producer cancel``, the Batch API's
cancel and expiry, a gateway client gone: each sets the batch's ``cancelled_at``,
``schemas.cancel``), or when its time limit passes: the least of its batch's job
timeout, the request's ``time_limit_s`` and the worker's ``--time-limit``, counted from
when it was taken. Whatever runs it asks at every step (a job alone through
``worker.engine.protocol.run_to_end``, a batch between its steps): a time limit costs a
clock read, cancel flags one pipelined ``HEXISTS`` per batch at most every
:data:`LOOK_EVERY_S`. The engine gives back what the job made (``Engine.remove``), and
its one record says why (``cancelled``, or failed with ``timeout``) with that text and
usage, cut (``worker.runner.records.stopped``); it is never requeued.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass

from redis import Redis
from redis.exceptions import RedisError

from schemas import CancelledError, JobTimeoutError, MlxqError, keys
from schemas.cancel import CANCELLED_AT
from worker.lifecycle.held import Job

log = logging.getLogger(__name__)

#: Seconds between two looks at the cancel flags of the batches of jobs running.
LOOK_EVERY_S = 0.2

#: The record's message for a job whose batch was cancelled while it ran.
CANCELLED_WHILE_RUNNING = (
    "cancelled while it ran (its batch was cancelled, or the client that asked for it "
    "went away); the text it made so far is in partial"
)


@dataclass(frozen=True)
class Deadline:
    """When a job must be done (a ``time.perf_counter()`` value), its time limit, and whose
    limit that is (``why``: named in the error)."""

    at: float
    timeout_s: float
    why: str = ""

    @property
    def passed(self) -> bool:
        return time.perf_counter() >= self.at

    def error(self) -> JobTimeoutError:
        whose = f" ({self.why})" if self.why else ""
        return JobTimeoutError(f"job timed out after {self.timeout_s:g}s{whose}")


def deadline_of(job: Job, worker_limit_s: float | None = None) -> Deadline | None:
    """The job's time limit, counted from when it was taken: the least of its batch's job
    timeout, its request's ``time_limit_s`` and the worker's ``--time-limit`` (None:
    none of them)."""
    limits = [
        (float(job.timeout_s or 0), "the batch's job timeout"),
        (float(getattr(job.envelope.request, "time_limit_s", None) or 0), "time_limit_s"),
        (float(worker_limit_s or 0), "the worker's --time-limit"),
    ]
    given = [(s, why) for s, why in limits if s > 0]
    if not given:
        return None
    seconds, why = min(given)
    return Deadline(job.started.perf + seconds, seconds, why)


class Stops:
    """Which running jobs must stop now, and why (one per batch, or one per job alone)."""

    def __init__(
        self, conn: Redis, worker_limit_s: float | None = None, every: float = LOOK_EVERY_S
    ) -> None:
        self.conn, self.worker_limit_s, self.every = conn, worker_limit_s, every
        self._cancelled: set[str] = set()  # batches seen cancelled (they stay so)
        self._look_at = 0.0

    def due(self, jobs: Iterable[Job]) -> list[tuple[Job, MlxqError]]:
        """Those of ``jobs`` that must stop now, each with what stops it."""
        jobs = list(jobs)
        if not jobs:
            return []
        now = time.monotonic()
        if now >= self._look_at:
            self._look_at = now + self.every
            self._look({j.envelope.batch_id for j in jobs} - self._cancelled)
        due: list[tuple[Job, MlxqError]] = []
        for job in jobs:
            if job.envelope.batch_id in self._cancelled:
                due.append((job, CancelledError(CANCELLED_WHILE_RUNNING)))
            elif (deadline := deadline_of(job, self.worker_limit_s)) and deadline.passed:
                due.append((job, deadline.error()))
        return due

    def _look(self, batches: set[str]) -> None:
        if not batches:
            return
        ordered = sorted(batches)
        try:
            with self.conn.pipeline(transaction=False) as pipe:
                for batch in ordered:
                    pipe.hexists(keys.batch_key(batch), CANCELLED_AT)
                flags = pipe.execute()
        except RedisError as e:  # the jobs run on; looked at again next time
            log.warning("could not read cancel flags (%s); looking again later", e)
            return
        self._cancelled.update(b for b, f in zip(ordered, flags, strict=True) if f)

    def of(self, job: Job) -> JobStop:
        """What stops ``job`` run alone (``worker.engine.protocol.Stop``)."""
        return JobStop(self, job)


class JobStop:
    """The stop rule of one job run alone: checked at each of its steps."""

    def __init__(self, stops: Stops, job: Job) -> None:
        self.stops, self.job = stops, job

    def check(self) -> None:
        for _, error in self.stops.due([self.job]):
            raise error
