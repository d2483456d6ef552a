"""The thread that renews a running job's lease while the job computes."""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING

from rq.job import Job
from rq.utils import now

if TYPE_CHECKING:
    from worker.rqworker import MlxqWorker

log = logging.getLogger(__name__)


class Heartbeat(threading.Thread):
    """Renews the running job's lease (and runs recovery passes) while the job computes.

    One thread serves all of a worker's jobs: starting and joining a thread per
    job put two thread hand-offs on every job's critical path, each waiting for
    the scheduler on a busy host. The thread wakes every ``interval`` seconds and
    beats for whichever job is being watched; ``release`` waits for a beat in
    progress, so no beat for a finished job lands after its bookkeeping.
    """

    def __init__(self, worker: MlxqWorker, interval: float) -> None:
        super().__init__(name=f"mlxq-heartbeat-{worker.name}", daemon=True)
        self.worker, self.interval = worker, interval
        self._lock = threading.Lock()
        self._job: Job | None = None
        self._closed = threading.Event()
        self._last_recovery = time.monotonic()

    def watch(self, job: Job) -> None:
        """Beat for ``job`` from now until :meth:`release`."""
        with self._lock:
            self._job = job

    def release(self) -> None:
        """Stop beating for the current job (after a beat in progress ends)."""
        with self._lock:
            self._job = None

    def close(self) -> None:
        self._closed.set()
        self.release()

    def run(self) -> None:
        while not self._closed.wait(self.interval):
            with self._lock:
                if self._job is not None:
                    self._beat(self._job)

    def _beat(self, job: Job) -> None:
        try:
            if self.worker.execution is None:
                return
            self.worker.maintain_heartbeats(job)
            self.worker.set_current_job_working_time(
                (now() - job.started_at).total_seconds() if job.started_at else 0
            )
            if time.monotonic() - self._last_recovery >= self.worker.maintenance_interval:
                self._last_recovery = time.monotonic()
                self.worker.recover()
        except Exception as e:  # Redis may be briefly away; the lease has slack
            log.warning("heartbeat for job %s failed: %s", job.id, e)
