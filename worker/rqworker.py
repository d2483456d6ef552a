"""The RQ worker: no fork, JSON only, mlxq's job function only, and no job lost.

RQ's default Worker forks a work horse per job (the model would reload every
job, and forking after Metal is initialised crashes on macOS) and imports any
dotted path stored in a job hash. ``MlxqWorker`` runs jobs in-process and
``SafeJob`` refuses anything but :data:`schemas.keys.JOB_FUNCTION`, ignores
callbacks and webhooks named in job hashes, and never unpickles.

Reliability on top of RQ (see ``worker.recovery``):
- every dequeue moves the job id atomically into the queue's intermediate list
  (LMOVE), also when serving several queues, where RQ would use a lossy BLPOP
  (``worker.dequeue``);
- a finished job keeps its lease until its result and bookkeeping are in Redis
  (sent off the job path, ``worker.bookkeeping``);
- a running job holds a short lease that a heartbeat thread renews, so a dead
  worker's job is requeued within about ``lease + lease/2`` seconds;
- a second SIGTERM requeues the current job instead of failing it;
- a worker restarted under the same name after a crash starts at once and
  hands its previous job back.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable, Iterable
from types import FrameType
from typing import Any

from rq import Queue, SimpleWorker
from rq.exceptions import StopRequested
from rq.executions import Execution
from rq.job import Job
from rq.serializers import JSONSerializer
from rq.utils import now

from schemas import InvalidRequestError, ResultRecord, keys
from schemas.store import queue_write_result, write_result
from worker import batching, recovery, registry, runtime
from worker.bookkeeping import Bookkeeper, Finished
from worker.dequeue import MlxqQueue, dequeuing, hand_back
from worker.heartbeat import Heartbeat

log = logging.getLogger(__name__)

DEFAULT_LEASE_S = 30
DEFAULT_MAX_CRASHES = 3


class UnsafeJobError(InvalidRequestError):
    """A job hash names something other than mlxq's job function."""

    code = "unsafe_job"


class ColdShutdown(BaseException):
    """Raised in the job by a second SIGTERM: the job is requeued, the worker exits."""


def _job_function() -> Callable[..., Any]:
    from worker.jobs import run_chat_job

    return run_chat_job


class SafeJob(Job):
    """An RQ job that can only ever call mlxq's job function."""

    #: Whether the job's result record existed when it started (read in the start
    #: MULTI/EXEC; None when unknown), so the job need not ask Redis again.
    result_existed: bool | None = None
    #: Set by the worker: the job leaves its result record in ``deferred_result``
    #: and the worker writes it with the job's success bookkeeping (no round trip
    #: of its own).
    defers_result: bool = False
    deferred_result: tuple[ResultRecord, int] | None = None

    def __init__(
        self, id: str | None = None, connection: Any = None, serializer: Any = None
    ) -> None:
        super().__init__(id=id, connection=connection, serializer=JSONSerializer)

    @property
    def func(self) -> Callable[..., Any]:
        name = self.func_name
        if name != keys.JOB_FUNCTION or self.instance is not None:
            raise UnsafeJobError(
                f"job {self.id} names function {name!r}; this worker runs only {keys.JOB_FUNCTION}"
            )
        return _job_function()

    # Callbacks and webhooks named in job data are never honoured.
    @property
    def success_callback(self) -> None:
        return None

    @property
    def failure_callback(self) -> None:
        return None

    @property
    def stopped_callback(self) -> None:
        return None

    def send_webhooks(self, status: Any, *, exc_string: str | None = None) -> None:
        return None

    def perform(self) -> Any:
        # RQ's perform() first PERSISTs the job hash (one round trip); mlxq job
        # hashes carry no TTL while they run, so go straight to the call.
        from rq.job import _job_stack

        _job_stack.push(self)
        try:
            self._result = self._execute()
        finally:
            _job_stack.pop()
        return self._result


class MlxqWorker(SimpleWorker):
    """A non-forking worker: models stay loaded in this process across jobs."""

    job_class = SafeJob
    queue_class = MlxqQueue

    def __init__(
        self,
        queues: Iterable[Queue | str],
        *args: Any,
        lease_s: int = DEFAULT_LEASE_S,
        max_crashes: int = DEFAULT_MAX_CRASHES,
        max_batch: int = 1,
        **kwargs: Any,
    ) -> None:
        kwargs["serializer"] = JSONSerializer
        kwargs.setdefault("job_class", SafeJob)
        kwargs.setdefault("queue_class", MlxqQueue)
        self.lease_s = max(1, int(lease_s))
        self.max_crashes = max_crashes
        self.max_batch = max_batch
        kwargs.setdefault("maintenance_interval", max(1, self.lease_s // 2))
        names = [q.name if isinstance(q, Queue) else q for q in queues]
        super().__init__(names, *args, **kwargs)
        self._cold = False
        self._beat: Heartbeat | None = None
        self._published_at = 0.0
        self._beat_at = 0.0
        self._suspension_checked_at = 0.0
        self._prepared_job_id: str | None = None
        self._idle_owed = False
        self.taking = False
        self._books = Bookkeeper(self)

    # -- leases -------------------------------------------------------------
    def get_heartbeat_ttl(self, job: Job) -> int:
        return self.lease_s

    @property
    def dequeue_timeout(self) -> int:
        # Come back from blocking often enough to run recovery passes.
        return max(1, self.lease_s // 2)

    def execute_job(self, job: Job, queue: Queue) -> None:
        if self.max_batch > 1 and (envelope := batching.envelope_of(job)) is not None:
            depth = 1
            if envelope.request.draft_model:  # batch or speculate: how many wait?
                depth += min(self.connection.llen(queue.key), self.max_batch - 1)
            taken = batching.batch_key(envelope, runtime.current(), depth)
            if taken is not None and job.func_name == keys.JOB_FUNCTION:
                key, decision = taken
                self._books.drain()  # the batch checks results in Redis as jobs join
                self.set_state("busy")
                self.set_current_job_id(job.id)
                try:
                    batching.BatchRunner(self, queue, key, depth).run(job, decision)
                finally:
                    self.set_current_job_id(None)
                return
        self.prepare_execution(job)
        self._books.release()  # the last job's bookkeeping goes while this one runs
        if self._beat is None:  # one thread for the worker's life: none started per job
            self._beat = Heartbeat(self, interval=max(0.5, self.lease_s / 3))
            self._beat.start()
        self._beat.watch(job)
        try:
            self.perform_job(job, queue)
        finally:
            self._beat.release()
        if self._cold:
            raise SystemExit(0)

    # -- per-job round trips -------------------------------------------------
    # RQ spends about five round trips between two jobs. mlxq: one takes the job
    # (LMOVE and its hash, worker.dequeue), one starts it (below); the last job's
    # end goes from the bookkeeper thread while this one runs.
    def prepare_execution(self, job: Job) -> Execution:
        """The execution record, worker state and job start in one MULTI/EXEC."""
        # A copy of a job whose finished run is still with the bookkeeper: its
        # record is not in Redis yet. (Asked before the EXISTS below, so a send
        # completing in between is seen by one or the other.)
        finished_here = self._books.has(job.id)
        with self.connection.pipeline() as pipe:
            ttl = self.get_heartbeat_ttl(job)
            self.execution = Execution.create(job, ttl, pipeline=pipe, worker_name=self.name)
            self.set_state("busy", pipeline=pipe)
            self._start_job(job, pipe)
            pipe.exists(keys.result_key(job.id))
            *_, existed = pipe.execute()
        if isinstance(job, SafeJob):
            job.result_existed = bool(existed) or finished_here
            job.defers_result = True
        self._idle_owed = False
        self._prepared_job_id = job.id
        return self.execution

    def prepare_job_execution(self, job: Job, remove_from_intermediate_queue: bool = False) -> None:
        if self._prepared_job_id == job.id:  # done with the execution record
            self._prepared_job_id = None
            return
        with self.connection.pipeline() as pipe:
            self._start_job(job, pipe)
            pipe.execute()

    def _start_job(self, job: Job, pipe: Any) -> None:
        """RQ's prepare_job_execution, queued on ``pipe``; the id always leaves the
        intermediate list (every dequeue goes through one, whatever the number of queues)."""
        self.set_current_job_id(job.id, pipeline=pipe)
        self.set_current_job_working_time(0, pipeline=pipe)
        ttl = self.get_heartbeat_ttl(job)
        self.heartbeat(ttl, pipeline=pipe)
        job.heartbeat(now(), ttl, pipeline=pipe)
        job.prepare_for_execution(self.name, pipeline=pipe)
        pipe.lrem(keys.rq_intermediate_key(job.origin), 1, job.id)

    def set_state(self, state: str, pipeline: Any = None) -> None:
        # RQ says "idle" before every dequeue. Redis hears it only when the worker
        # really waits (going_idle): on a busy queue it goes from job to job.
        if pipeline is None and state == "idle":
            self._state = state
            self._idle_owed = True
            return
        super().set_state(state, pipeline=pipeline)

    def going_idle(self) -> None:
        """The queues are empty: send held bookkeeping, tell Redis the worker is idle."""
        self._books.release()
        if self._idle_owed:
            with self.connection.pipeline() as pipe:
                pipe.hset(self.key, "state", "idle")
                pipe.hdel(self.key, "current_job")
                pipe.execute()
            self._idle_owed = False

    def check_for_suspension(self, burst: bool) -> None:
        # `rq suspend` is honoured within a second; not one round trip per job.
        if time.monotonic() - self._suspension_checked_at >= 1.0:
            self._suspension_checked_at = time.monotonic()
            super().check_for_suspension(burst)

    def handle_execution_ended(self, job: Job, queue: Queue, heartbeat_ttl: int) -> None:
        # RQ also sends a job heartbeat here (a round trip); the lease is ours.
        job.ended_at = now()
        if self._beat is not None:
            self._beat.release()  # no beat may touch the execution record from here on

    def finish_success(self, job: Job, execution: Execution | None, pipe: Any) -> int | None:
        """RQ's success bookkeeping for one job, queued on ``pipe`` (no dependents to watch).

        A result record the job deferred is queued first; returns its reply's index.
        """
        write_at = None
        if isinstance(job, SafeJob) and job.deferred_result is not None:
            write_at = len(pipe.command_stack)
            queue_write_result(pipe, *job.deferred_result)
            job.deferred_result = None
        self.increment_successful_job_count(pipeline=pipe)
        if job.started_at and job.ended_at:
            self.increment_total_working_time(job.ended_at - job.started_at, pipe)
        result_ttl = job.get_result_ttl(self.default_result_ttl)
        if result_ttl != 0:
            job._handle_success(
                result_ttl,
                pipeline=pipe,
                worker_name=self.name,
                execution_id=execution.id if execution else None,
                execution_started_at=execution.created_at if execution else None,
                execution_ended_at=job.ended_at,
            )
        job.cleanup(result_ttl, pipeline=pipe, remove_from_queue=False)
        return write_at

    def handle_job_success(self, job: Job, queue: Queue, started_job_registry: Any) -> None:
        """RQ's success bookkeeping and the job's result record: sent by the bookkeeper
        thread once the next job has started (:mod:`worker.bookkeeping`)."""
        self._books.hold(Finished(job, self.execution))
        self.execution = None

    def dequeue_job_and_maintain_ttl(
        self, timeout: int | None, max_idle_time: int | None = None
    ) -> tuple[Job, Queue] | None:
        with dequeuing(self):
            taken = super().dequeue_job_and_maintain_ttl(timeout, max_idle_time)
        if taken is not None and self._stop_requested:
            # Stop was asked while the job was being taken: give it back, unstarted.
            job, queue = taken
            hand_back(self.connection, queue, job.id)
            raise StopRequested()
        return taken

    def _shutdown(self) -> None:
        # Between jobs RQ stops at once by raising from the signal handler. During
        # a take that would strand the job just taken: stop when the take returns.
        if self.taking:
            self._stop_requested = True
            return
        super()._shutdown()

    def run_maintenance_tasks(self) -> None:
        self._books.release()
        super().run_maintenance_tasks()

    # -- recovery -----------------------------------------------------------
    def recover(self) -> recovery.RecoveryReport:
        """One recovery pass over the served queues."""
        report = recovery.RecoveryReport()
        for queue in self.queues:
            report.extend(
                recovery.recover_queue(
                    self.connection,
                    queue.name,
                    max_crashes=self.max_crashes,
                    stuck_grace_s=self.lease_s,
                    worker_id=self.name,
                )
            )
        return report

    def clean_registries(self) -> None:
        self.recover()
        super().clean_registries()

    # -- fleet registry -----------------------------------------------------
    @property
    def registry_ttl(self) -> int:
        """Seconds a published entry outlives the last publish (several heartbeats)."""
        return max(6, 3 * self.dequeue_timeout)

    def publish(self, force: bool = False) -> None:
        """Publish this worker's state on ``mlxq:worker:<name>`` (at most every 2 s)."""
        if not force and time.monotonic() - self._published_at < 2.0:
            return
        self._published_at = time.monotonic()
        info = registry.worker_info(
            runtime.current(),
            self.name,
            self.queue_names(),
            str(self.get_state()),
            self.get_current_job_id(),
        )
        registry.publish(self.connection, info, self.registry_ttl)

    def heartbeat(self, timeout: int | None = None, pipeline: Any = None) -> None:
        # RQ beats several times per job; the worker key lives worker_ttl (minutes),
        # so plain beats are sent at most once a second (one Redis round trip each).
        now_s = time.monotonic()
        if timeout is None and pipeline is None and now_s - self._beat_at < 1.0:
            return
        if timeout is None and pipeline is None:
            self._beat_at = now_s
        super().heartbeat(timeout, pipeline=pipeline)
        try:
            self.publish()
        except Exception as e:  # the registry is informative; never fail a job for it
            log.debug("publishing worker state failed: %s", e)

    def unsubscribe(self) -> None:
        # RQ unsubscribes, then stops its pubsub listener thread. When the thread
        # reads the unsubscribe reply before the stop, it waits for the next
        # message again and every exit stalls for join's full second: stop first.
        if self.pubsub_thread:
            self.pubsub_thread.stop()
        super().unsubscribe()

    def register_death(self) -> None:
        if self._beat is not None:
            self._beat.close()
        if self._books.is_alive():
            self._books.close()
        try:
            registry.unpublish(self.connection, self.name)
        finally:
            super().register_death()

    # -- restarts and shutdown ----------------------------------------------
    def register_birth(self) -> None:
        self._reclaim_name()
        super().register_birth()
        if not self._books.is_alive():
            self._books = Bookkeeper(self)
            self._books.start()

    def _reclaim_name(self) -> None:
        """Take over our name from a previous process of ours on this host that died."""
        data = {k.decode(): v.decode() for k, v in self.connection.hgetall(self.key).items()}
        if not data or "death" in data:
            return
        pid, host = int(data.get("pid") or 0), data.get("hostname")
        if host != socket.gethostname():
            raise RuntimeError(
                f"worker name {self.name!r} is in use by a worker on host {host!r}; "
                f"pick another --name or wait {self.connection.ttl(self.key)}s for it to expire"
            )
        if pid and pid != os.getpid() and _alive(pid):
            raise RuntimeError(f"worker name {self.name!r} is in use by live process {pid}")
        for queue in self.queues:
            recovery.expire_leases_of_worker(self.connection, queue.name, self.name)
        self.connection.delete(self.key)
        log.warning("worker %s: previous process (pid %s) died; name reclaimed", self.name, pid)

    def handle_job_failure(self, job: Job, queue: Queue, *args: Any, **kwargs: Any) -> None:
        if isinstance(job, SafeJob) and job.deferred_result is not None:
            # The job finished (its record is final) before something else failed.
            write_result(self.connection, *job.deferred_result)
            job.deferred_result = None
        if self._cold:
            # Cold shutdown: hand the job back instead of failing it.
            with self.connection.pipeline() as pipe:
                self.cleanup_execution(job, pipe)
                pipe.execute()
            recovery.requeue(self.connection, queue.name, job.id)
            log.warning("worker %s: cold shutdown; job %s requeued", self.name, job.id)
            return
        super().handle_job_failure(job, queue, *args, **kwargs)

    def handle_exception(self, job: Job, *exc_info: Any) -> None:
        if not self._cold:
            super().handle_exception(job, *exc_info)

    def request_force_stop(self, signum: int, frame: FrameType | None) -> None:
        if self.get_state() == "busy" and self.get_current_job_id():
            self._cold = True
            raise ColdShutdown("second stop signal during a job")
        super().request_force_stop(signum, frame)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
