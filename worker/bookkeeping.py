"""A finished job's success bookkeeping, sent off the job path by one thread per worker.

After a job, RQ marks it finished (job hash, RQ result stream, registries,
worker counters) and mlxq writes its result record: one MULTI/EXEC, about a
millisecond of Python and Redis. Done inline, that millisecond sits between
every two jobs. The worker instead *holds* the finished job here, takes and
starts the next job, then *releases* it: this thread sends the bookkeeping while
the next job computes (or at once, when the worker goes idle or stops).

Until it is sent, the finished job still holds its lease; if the worker dies in
between, the job is rerun, and its result record is written once, by whichever
run writes first. The bookkeeping leaves the worker hash's ``state`` and
``current_job`` alone: by the time it lands they belong to the next job.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rq.executions import Execution
from rq.job import Job

if TYPE_CHECKING:
    from worker.rqworker import MlxqWorker

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Finished:
    """A job that returned, and its execution record."""

    job: Job
    execution: Execution | None


class Bookkeeper(threading.Thread):
    """Sends the success bookkeeping of the worker's finished jobs, in order."""

    def __init__(self, worker: MlxqWorker) -> None:
        super().__init__(name=f"mlxq-bookkeeper-{worker.name}", daemon=True)
        self.worker = worker
        self._cond = threading.Condition()
        self._held: list[Finished] = []
        self._ready: list[Finished] = []
        self._sending: list[Finished] = []
        self._closed = False

    def hold(self, finished: Finished) -> None:
        """Keep ``finished`` until :meth:`release` (the next job starts first)."""
        with self._cond:
            self._held.append(finished)

    def has(self, job_id: str) -> bool:
        """Whether a run of ``job_id`` finished here and its bookkeeping is not sent yet."""
        with self._cond:
            return any(f.job.id == job_id for f in (*self._held, *self._ready, *self._sending))

    def release(self) -> None:
        """Send what is held, in the background."""
        with self._cond:
            if self._held:
                self._ready.extend(self._held)
                self._held.clear()
                self._cond.notify_all()

    def drain(self, timeout: float = 120.0) -> bool:
        """Release and wait until all is sent; False if that took longer than ``timeout``."""
        deadline = time.monotonic() + timeout
        self.release()
        with self._cond:
            while self._ready or self._sending:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def close(self, timeout: float = 120.0) -> None:
        """Send what is left, then end the thread."""
        sent = self.drain(timeout)
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if not sent:
            log.error("worker %s: bookkeeping of finished jobs not sent in time", self.worker.name)

    def run(self) -> None:
        while True:
            with self._cond:
                while not self._ready and not self._closed:
                    self._cond.wait()
                if not self._ready:
                    return
                batch, self._ready = self._ready, []
                self._sending = batch
            try:
                self.send(batch)
            except Exception as e:  # Redis away longer than the client retries
                ids = ", ".join(f.job.id for f in batch)
                log.error("bookkeeping of jobs %s not sent (leases will rerun them): %s", ids, e)
            finally:
                with self._cond:
                    self._sending = []
                    self._cond.notify_all()

    def send(self, batch: list[Finished]) -> None:
        """One MULTI/EXEC for ``batch``: result records first, then RQ's bookkeeping."""
        with self.worker.connection.pipeline() as pipe:
            writes: list[tuple[str, int | None]] = []
            for f in batch:
                writes.append((f.job.id, self.worker.finish_success(f.job, f.execution, pipe)))
                if f.execution is not None:
                    f.execution.delete(job=f.job, pipeline=pipe)
            replies: list[Any] = pipe.execute(raise_on_error=False)
        errors = [r for r in replies if isinstance(r, Exception)]
        if errors:
            log.error("bookkeeping of finished jobs failed in part: %s", errors[0])
        for job_id, at in writes:
            if at is not None and replies[at] == 0:
                log.info("job %s: a result already existed; kept the first", job_id)
