"""The worker loop: take a job, run it alone or open a batch; step the batch's lanes a
turn at a time until it ends; repeat.

mlxq's own loop, not RQ's ``Worker``: it never forks (models stay loaded, and
forking after Metal is initialised crashes on macOS), never imports a function
named in Redis, and every job goes through one lifecycle (``worker.lifecycle.held``)
whatever runs it. One heartbeat thread keeps the process's lease (which covers
all its jobs), runs recovery and publishes the worker's state.

Signals: the first SIGTERM or SIGINT is a warm stop (no new jobs; running ones
finish, a job taken at that moment is handed back; exit 0). A worker that holds no
job stops at once, even while it waits for an unreachable Redis. A second signal is
a cold stop, wherever the worker is: running jobs go back to the front of their
queue, unfinished. From a stop on, each Redis command is tried once, so a Redis
that is gone cannot hold the exit: what the worker could not hand back returns to
its queue when the worker's lease ends, as after a crash.
"""

from __future__ import annotations

import functools
import logging
import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType

from redis import Redis
from redis.backoff import NoBackoff
from redis.exceptions import RedisError
from redis.retry import Retry

from schemas import ResultRecord, keys
from schemas.fleet import BatchInfo
from worker.engine.memory import wired_limit
from worker.lifecycle import registry
from worker.lifecycle.heartbeat import Heartbeat
from worker.lifecycle.held import (
    BLOCK_S,
    DEFAULT_LEASE_S,
    DEFAULT_MAX_CRASHES,
    Job,
    Lifecycle,
    Refused,
)
from worker.runner.alone import run_alone
from worker.runner.audiojobs import is_audio, serve_audio
from worker.runner.company import PEEK
from worker.runner.embedjobs import gather, is_embedding, run_embeddings
from worker.runner.figures import SharedFigures
from worker.runner.fleet import worker_info
from worker.runner.lanes import AUTO_CAP, Lanes
from worker.runner.runtime import WorkerRuntime
from worker.schedule.route import Route, route
from worker.schedule.step import DEFAULT_MODEL_WAIT_S, model_waits

log = logging.getLogger(__name__)


class ColdShutdown(BaseException):
    """A second stop signal during a job: the job goes back to its queue, the worker exits."""


class StopWaiting(BaseException):
    """A stop signal while the worker waited for a job (or for Redis): it holds none."""


class Worker:
    """Serves mlxq jobs from Redis queues (first queue first) with warm models."""

    def __init__(
        self,
        conn: Redis,
        queues: list[str],
        rt: WorkerRuntime,
        *,
        name: str,
        lease_s: float = DEFAULT_LEASE_S,
        max_crashes: int = DEFAULT_MAX_CRASHES,
        max_batch: int | None = 1,
        burst: bool = False,
        max_jobs: int | None = None,
        wait_replicas: int = 0,
        model_wait_s: float = DEFAULT_MODEL_WAIT_S,
    ) -> None:
        self.conn, self.queues, self.rt, self.name = conn, list(queues), rt, name
        self.lifecycle = Lifecycle(
            conn,
            name,
            self.queues,
            lease_s=lease_s,
            max_crashes=max_crashes,
            wait_replicas=wait_replicas,
        )
        # ``--model-wait``: how long each queue's job for another model may be passed over
        self.model_wait_s = model_wait_s
        self.waits = model_waits(self.queues, model_wait_s)
        # max_batch None is ``--max-batch auto``: memory and measured speed decide.
        self.max_batch, self.burst, self.max_jobs = max_batch, burst, max_jobs
        self.batch: BatchInfo | None = None  # the running batch's state (``producer fleet``)
        self.taken = 0  # jobs taken (refused ones included): what --max-jobs counts
        # The policy's figures, shared with the fleet (``--share-figures``).
        self.figures = (
            SharedFigures(conn, rt.policy, rt.find_local, name, rt.machine_kind)
            if rt.share_figures
            else None
        )
        self.state = "starting"
        self.current: str | None = None
        self._stop = self._cold = self._computing = False
        self.lanes = Lanes(self)  # the running batch's lanes, stepped a turn at a time

    @property
    def registry_ttl(self) -> int:
        """Seconds a published state outlives the last publish (a few heartbeats)."""
        return max(6, int(1.5 * self.lifecycle.lease_ms / 1000))

    # -- running ----------------------------------------------------------
    def work(self) -> None:
        """Register, serve until stopped (or the queues are empty with ``burst``), unregister."""
        registry.claim_name(self.conn, self.name)
        self.lifecycle.register()
        registry.rq_birth(self.conn, self.name, self.queues, self.lifecycle.worker_ttl)
        restore = self._install_signals()
        beat = Heartbeat(self.lifecycle, self.publish)
        beat.start()
        try:
            self.publish()
            with wired_limit():  # set once for every engine while the worker serves
                self._loop()
        except ColdShutdown:
            log.warning("worker %s: cold stop; running jobs handed back", self.name)
        except StopWaiting:
            log.warning("worker %s: stopped while waiting for a job", self.name)
        except RedisError as e:
            if not self._stop:
                raise
            log.warning(
                "worker %s: %s; Redis unreachable (%s): the jobs it holds go back to their "
                "queues when its lease ends",
                self.name,
                "cold stop" if self._cold else "stopping",
                e,
            )
        finally:
            if self._stop:
                self._fail_fast()
            beat.close(timeout=1.0 if self._stop else 5.0)
            try:
                self._unregister()
            finally:
                restore()

    def _unregister(self) -> None:
        if self.figures is not None:
            self.figures.publish()  # what the last jobs measured (never raises)
        try:
            self.lifecycle.unregister()
            registry.rq_death(self.conn, self.name, self.queues)
            registry.unpublish(self.conn, self.name)
        except RedisError as e:
            if not self._stop:
                raise
            log.warning(
                "worker %s: Redis unreachable at exit (%s); the jobs it held go back to "
                "their queues when its lease ends",
                self.name,
                e,
            )

    def _fail_fast(self) -> None:
        """One try per Redis command from now on (a stop must not wait out an outage)."""
        self.conn.set_retry(Retry(NoBackoff(), 0))

    def _loop(self) -> None:
        """The one loop: while a batch runs, a turn of its lanes (``worker.runner.lanes``:
        plan, step, take jobs into them, end records); else take a job (waiting for one)
        and run it, alone or opening a batch."""
        lanes = self.lanes
        while lanes.live or self.may_take():
            if lanes.live:
                lanes.turn()
                if not lanes.live:
                    self.state, self.current = "idle", None
                continue
            # a stop signal interrupts the take's waits (StopWaiting), not its scripts
            # jobs for the models loaded here first (a mixed queue does not thrash them)
            warm = self.rt.cache.loaded_models()
            got = self.lifecycle.take(
                block_s=0.0 if self.burst else BLOCK_S, warm=warm, waits=self.waits
            )
            if got is None and self._stop:  # the stop came just before the wait
                raise StopWaiting("stop requested")
            if got is None:
                self.state, self.current = "idle", None
                if self.burst:
                    return
                continue
            job = self._accept(got)
            if job is not None:
                self._run(job)
                if not lanes.live:
                    self.state, self.current = "idle", None  # until the next take starts one

    def may_take(self) -> bool:
        return not self._stop and (self.max_jobs is None or self.taken < self.max_jobs)

    def _accept(self, got: Job | Refused) -> Job | None:
        """Count a taken job; end it if refused, hand it back if a stop came meanwhile."""
        self.taken += 1
        if isinstance(got, Refused):
            self.lifecycle.refuse(got)
            self.rt.stats.failed += 1
            return None
        if self._stop:  # the stop came while this job was being taken: it was not begun
            self.lifecycle.requeue(got)
            return None
        if self.lifecycle.over_quota(got):  # its tenant's tokens of the day are used
            self.rt.stats.failed += 1
            return None
        log.info("job %s begun", got.id)  # from here a stop lets it end (or hands it back)
        return got

    def _run(self, job: Job) -> None:
        self.state, self.current = "busy", job.id
        if is_embedding(job):
            self.run_embeddings(job)
            return
        if is_audio(job):
            serve_audio(self, job)
            return

        queue = keys.base_queue(job.queue)  # a tenant's list joins its queue's batches

        def depth() -> int:  # batch or speculate: how many wait?
            return 1 + min(self.lifecycle.waiting(queue), (self.max_batch or AUTO_CAP) - 1)

        r = route(job.envelope.request, self.rt.policy, depth, batching=self.max_batch != 1)
        if r.batch is not None:
            self.lanes.open(queue, r.batch, r.depth, job, r)  # stepped by the loop's turns
            return
        self.run_alone(job, r)

    def run_alone(self, job: Job, r: Route) -> None:
        """Run ``job`` alone as routed and end it (also between a batch's steps)."""
        try:
            with self.computing():
                upcoming = functools.partial(self.lifecycle.peek, job.queue, PEEK)  # its mates
                record, after = run_alone(job, r, self.rt, self.conn, upcoming)
        except BaseException:
            self.lifecycle.requeue(job)
            raise
        self.finish([(job, record)])
        if after is not None:
            after()  # a streamed job's final chunk, once its record can be read

    def run_embeddings(self, first: Job) -> None:
        """Embed ``first`` with the jobs behind it that use the same model, and end them."""
        queue = keys.base_queue(first.queue)
        jobs = gather(first, lambda: self.take_from(queue), self.lifecycle.requeue)
        try:
            with self.computing():
                ended = run_embeddings(jobs, self.rt)
        except BaseException:
            for job in jobs:
                self.lifecycle.requeue(job)
            raise
        self.finish(ended)

    # -- what the lanes ask of their worker --------------------------------
    def take_from(self, queue: str, model: str | None = None) -> Job | None:
        """The next job of ``queue`` to join a batch (refused ones are ended on the way), or
        None if the queue is empty or the worker must not take more. ``model``: the
        batch's, whose jobs come first (``--model-wait``)."""
        while self.may_take():
            warm, waits = ((model,), model_waits([queue], self.model_wait_s)) if model else ((), ())
            got = self.lifecycle.take([queue], warm=warm, waits=waits)
            if got is None:
                return None
            job = self._accept(got)
            if job is not None:
                return job
        return None

    def finish(self, ended: list[tuple[Job, ResultRecord]]) -> None:
        """End jobs with their records (one round trip)."""
        wrote = self.lifecycle.end_many(ended)
        for (job, record), w in zip(ended, wrote, strict=True):
            log.info("job %s %s", job.id, record.status)
            if w:
                self.rt.stats.ended(record, job.queue)

    @contextmanager
    def computing(self) -> Iterator[None]:
        """Model loading and generation: a second stop signal interrupts it (ColdShutdown).
        Nests (a job run alone between two chunks of a batch's prefill)."""
        outer, self._computing = self._computing, True
        try:
            if self._cold:
                raise ColdShutdown("second stop signal")
            yield
        finally:
            self._computing = outer

    # -- signals ----------------------------------------------------------
    def request_stop(self, signum: int = signal.SIGTERM, frame: FrameType | None = None) -> None:
        """A stop signal: warm the first time (at once if no job is held), cold the second."""
        if not self._stop:
            self._stop = self.lifecycle.stopping = True
            if self.lifecycle.blocked:
                self._fail_fast()
                raise StopWaiting(f"signal {signum}")
            log.warning(
                "worker %s: stopping after the running job(s) (signal %s)", self.name, signum
            )
            return
        self._cold = True
        self._fail_fast()
        raise ColdShutdown("second stop signal")

    def _install_signals(self) -> Callable[[], None]:
        """Route SIGTERM and SIGINT to :meth:`request_stop`; returns what restores them."""
        if threading.current_thread() is not threading.main_thread():
            return lambda: None
        previous = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
        for s in previous:
            signal.signal(s, self.request_stop)

        def restore() -> None:
            for s, handler in previous.items():
                signal.signal(s, handler)

        return restore

    # -- the fleet registry -----------------------------------------------
    def publish(self) -> None:
        """Publish this worker's state on ``mlxq:worker:<name>`` (``producer fleet``)."""
        info = worker_info(
            self.rt,
            self.name,
            self.queues,
            self.state,
            self.current,
            self.batch,
            self.max_batch,
            lease_s=self.lifecycle.lease_ms / 1000,
            replica_shortfalls=self.lifecycle.wait_shortfalls,
            figures=self.figures,
        )
        registry.publish(self.conn, info, self.registry_ttl)
        if self.figures is not None:
            self.figures.publish()
