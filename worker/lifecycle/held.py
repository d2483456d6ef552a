"""A job's transitions: take (and start), refuse, end, requeue. Redis only, no MLX.

Every job a worker runs goes through these functions, whichever engine makes
its tokens (alone, batched, speculative, streamed); the state transitions are
the Lua scripts of :mod:`worker.lifecycle.scripts`, where the key layout is documented
(states and scripts: docs/lifecycle.md). The lease these jobs ride on and the fleet's
upkeep (recovery, poison, reconcile, pruning) are :mod:`worker.lifecycle.upkeep`'s.

mlxq owns this lifecycle on RQ's data model: producers enqueue with RQ
(``enqueue_many``), jobs are RQ job hashes on RQ queue lists, and a worker
keeps RQ's job status, registries and worker record up to date, so ``rq info``
and rq-dashboard show queues, workers and started / finished / failed jobs. It
uses no RQ code: a job hash is read by :func:`schemas.read_job_hash` (JSON
only, mlxq's function only) before anything else looks at it.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import secrets
import socket
import threading
import time
import zlib
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from redis import Redis
from redis.exceptions import NoScriptError

from schemas import (
    ENDED_JOB_DATA,
    ChatRequest,
    InvalidRequestError,
    JobEnvelope,
    JobRefused,
    Metrics,
    MlxqError,
    QuotaExceededError,
    ResultRecord,
    UnsafeJobError,
    keys,
    lanes,
    read_job_hash,
)
from schemas.connect import WAIT_TIMEOUT_MS, wait_for_replicas
from schemas.embeddings import EmbeddingRequest
from schemas.keys import rq_time
from schemas.store import write_once_call
from worker.lifecycle import scripts
from worker.lifecycle.upkeep import Upkeep

log = logging.getLogger(__name__)

DEFAULT_LEASE_S = 30
DEFAULT_MAX_CRASHES = 3
#: Longest single blocking wait (seconds): a stop request is seen at least this often.
BLOCK_S = 1.0
#: Seconds a worker keeps the tenants' token quotas it read (``mlxq:tenant-quotas``).
QUOTA_READ_S = 5.0


@dataclass(frozen=True)
class Start:
    """When a job started: wall clock (for queue wait) and perf counter (for durations)."""

    wall: float = field(default_factory=time.time)
    perf: float = field(default_factory=time.perf_counter)

    def elapsed(self) -> float:
        return time.perf_counter() - self.perf


@dataclass(frozen=True)
class Job:
    """A job this worker holds: taken and started in Redis, not ended yet."""

    id: str
    queue: str
    envelope: JobEnvelope
    timeout_s: int | None = None
    started: Start = field(default_factory=Start)


@dataclass(frozen=True)
class Refused:
    """A taken job hash that is not a runnable mlxq job (see :class:`schemas.JobRefused`)."""

    id: str
    queue: str
    refusal: JobRefused


@dataclass(frozen=True)
class _Ending:
    """What ``scripts.END`` needs to end one job (``record`` None: end it without one)."""

    job_id: str
    queue: str
    record: ResultRecord | None
    ttl: int
    worked: float
    error: str = ""


class Lifecycle(Upkeep):
    """One worker process's side of the lifecycle: its lease token and its transitions."""

    def __init__(
        self,
        conn: Redis,
        name: str,
        queues: list[str],
        *,
        lease_s: float = DEFAULT_LEASE_S,
        max_crashes: int = DEFAULT_MAX_CRASHES,
        wait_replicas: int = 0,
    ) -> None:
        if not queues:
            raise ValueError("a worker serves at least one queue")
        self.conn, self.name, self.queues = conn, name, list(queues)
        self.lease_ms = max(1000, int(lease_s * 1000))
        self.max_crashes = max_crashes
        # After writing records: WAIT for this many replicas (``--wait-replicas``), and
        # the writes fewer acknowledged within WAIT_TIMEOUT_MS.
        self.wait_replicas, self.wait_shortfalls = wait_replicas, 0
        self.token = secrets.token_hex(8)
        self.inbox = keys.inbox_key(self.token)
        self._wake_keys = list(dict.fromkeys(keys.wake_key(q) for q in self.queues))
        self.blocked = False  # in a take's wait (a stop signal may interrupt it there)
        self.stopping = False  # set by the worker's stop: a take then waits no more
        self.worker_key = keys.rq_worker_key(name)
        self.host, self.pid = socket.gethostname(), os.getpid()
        # The two scripts every job runs: sent by SHA (EVALSHA), not as ~2 KB of text a call.
        self._take = conn.register_script(scripts.TAKE)
        self._end = conn.register_script(scripts.END)
        self.holder = json.dumps(
            {"name": name, "host": self.host, "pid": self.pid, "inbox_queue": self.queues[0]}
        )
        # The jobs this process took and has not ended or handed back (the main thread
        # writes it, the heartbeat's reconcile reads it), and the ids Redis lists as
        # held here that were not in it at the last reconcile.
        self.holding: set[str] = set()
        self._quotas: dict[str, int] = {}
        self._quotas_at = -QUOTA_READ_S
        self._holding_lock = threading.Lock()
        self._suspects: set[str] = set()

    def _held(self, job_id: str) -> None:
        with self._holding_lock:
            self.holding.add(job_id)

    def _released(self, *job_ids: str) -> None:
        with self._holding_lock:
            self.holding.difference_update(job_ids)

    # -- the transitions --------------------------------------------------
    def take(
        self,
        queues: list[str] | None = None,
        block_s: float = 0.0,
        warm: Sequence[str] = (),
        waits: Sequence[int] = (),
    ) -> Job | Refused | None:
        """The next job of ``queues`` (default: the worker's, first queue first), started.

        Waits up to ``block_s`` seconds for one (only on the worker's own queues). Jobs
        for the ``warm`` models (loaded here) come first, each queue's list passing over
        a job for another model for at most its ``waits`` milliseconds of age (one per
        queue: ``worker.schedule.step.model_waits``; ``schemas/lua/affine.lua``).
        Copies of a job held right now, or of one that has its record, and jobs of
        cancelled batches are dropped on the way. None when nothing came (or
        ``rq suspend`` holds the workers).
        """
        queues = queues or self.queues
        deadline = time.monotonic() + block_s
        while True:
            reply = self._take_once(queues, warm, waits)
            if reply == "suspended":
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                with self._blocking():
                    if not self.stopping:
                        time.sleep(min(left, BLOCK_S))
                continue
            if reply is not None:
                return reply
            left = deadline - time.monotonic()
            if left <= 0 or queues != self.queues:
                return None
            wait = min(left, BLOCK_S)
            # Wait for a wake token of any queue served (every script that puts a job on
            # one of their lists leaves one): then take again. A job put there some other
            # way is found at the next take, BLOCK_S at most later.
            with self._blocking():
                if self.stopping:
                    return None
                self.conn.blpop(self._wake_keys, wait)

    @contextmanager
    def _blocking(self) -> Iterator[None]:
        """Mark the only stretches of a take that a stop signal may interrupt: the waits,
        never a script that starts a job (an id moved to the inbox is handed back at exit).
        ``blocked`` is set before ``stopping`` is read, and a stop sets ``stopping`` before
        reading ``blocked``: a stop either interrupts the wait or is seen before it."""
        self.blocked = True
        try:
            yield
        finally:
            self.blocked = False

    def _take_once(
        self, queues: list[str], warm: Sequence[str] = (), waits: Sequence[int] = ()
    ) -> Job | Refused | str | None:
        if warm and any(waits) and len(waits) != len(queues):
            raise ValueError(f"{len(waits)} model waits for {len(queues)} queues")
        affine = [*waits, *warm] if warm and any(waits) else []
        while True:
            now = rq_time()
            reply = self._take(
                keys=[
                    *(keys.RUNNING, keys.LEASES, self.inbox, self.worker_key, keys.RQ_SUSPENDED),
                    *[keys.rq_queue_key(q) for q in queues],
                ],
                args=[
                    *(self.token, self.lease_ms, self.name, now),
                    *(keys.rq_job_key(""), keys.result_key(""), keys.rq_started_key("")),
                    *(keys.batch_key(""), self.queues[0], *queues),
                    *affine,
                ],
            )
            if not reply:
                return None
            kind = reply[0].decode()
            if kind == "suspended":
                return kind
            if kind == "dropped":
                log.info("%s: dropped %d job(s) of cancelled batches", self.name, reply[1])
                continue
            job_id, queue = reply[1].decode(), reply[2].decode()
            if kind in ("start", "missing"):
                self._held(job_id)
            if kind == "start":
                flat = reply[3]
                fields = dict(zip(flat[::2], flat[1::2], strict=True))
                try:
                    stored = read_job_hash(job_id, fields)
                except JobRefused as e:
                    return Refused(job_id, queue, e)
                return Job(job_id, queue, stored.envelope, stored.timeout_s)
            if kind == "missing":
                return Refused(
                    job_id,
                    queue,
                    JobRefused("missing", f"queue {queue!r} held an id with no job hash"),
                )
            log.info(
                "job %s: dropped a copy (%s)", job_id, "running now" if kind == "held" else kind
            )

    def over_quota(self, job: Job) -> bool:
        """End ``job`` failed (429 ``quota_exceeded``) if its tenant has used its tokens of
        the UTC day; True if so. Quotas are read at most every :data:`QUOTA_READ_S`, usage
        at each job of a tenant that has one (jobs running meanwhile may go past it)."""
        tenant = keys.tenant_of(job.queue)
        if time.monotonic() - self._quotas_at > QUOTA_READ_S:
            self._quotas = {
                k.decode(): int(v)
                for k, v in self.conn.hgetall(keys.TENANT_QUOTAS).items()
                if v.isdigit()
            }
            self._quotas_at = time.monotonic()
        quota = self._quotas.get(tenant)
        if quota is None:
            return False
        day = keys.usage_key(keys.usage_day(time.time()))
        used = sum(
            int(v or 0)
            for v in self.conn.hmget(day, f"{tenant}:prompt_tokens", f"{tenant}:completion_tokens")
        )
        if used < quota:
            return False
        error = QuotaExceededError(
            f"tenant {tenant!r} has used {used} of its {quota} tokens today (UTC): "
            "not run (producer retry runs it again once the quota allows)"
        )
        self._fail_unrun(job.id, job.queue, job.envelope.model_dump(), error)
        return True

    def refuse(self, refused: Refused) -> bool:
        """End a refused job: RQ's status failed; a failed record when the job names its
        batch (or its id is an mlxq job id of a known batch); and the dead-letter list
        unless it was merely an invalid request with a record. True if a record was written.
        """
        r = refused.refusal
        error: MlxqError = (
            UnsafeJobError(r.reason)
            if r.kind == "unsafe"
            else InvalidRequestError(
                r.reason if r.kind == "invalid" else f"job could not be read: {r.reason}"
            )
        )
        ids = self._ids(refused.id, r.payload)
        if r.kind != "invalid" or ids is None:
            dead_letter(self.conn, refused.id, r.reason)
        return self._end_unrun(refused.id, refused.queue, ids, _ttl(r.payload), error, r.reason)

    def _fail_unrun(
        self, job_id: str, queue: str, payload: dict[str, Any] | None, error: MlxqError
    ) -> bool:
        """End a job that did not run with a failed record (when it names its batch, see
        :meth:`_ids`). True if a record was written."""
        ids = self._ids(job_id, payload)
        return self._end_unrun(job_id, queue, ids, _ttl(payload), error, str(error))

    def _end_unrun(
        self,
        job_id: str,
        queue: str,
        ids: tuple[str, str, str] | None,
        ttl: int,
        error: MlxqError,
        reason: str,
    ) -> bool:
        record = None
        if ids is not None:
            record = ResultRecord.failed(*ids, error, metrics=Metrics(worker_id=self.name))
        return self._send([_Ending(job_id, queue, record, ttl, 0.0, reason)])[0]

    def _ids(self, job_id: str, payload: dict[str, Any] | None) -> tuple[str, str, str] | None:
        """(job id, batch id, custom_id) to put on a refused job's record, if it has a batch."""
        if payload and payload.get("job_id") == job_id:
            batch, custom = payload.get("batch_id"), payload.get("custom_id")
            if isinstance(batch, str) and batch and isinstance(custom, str):
                return job_id, batch, custom
        batch = keys.batch_of(job_id)
        if keys.is_job_id(job_id) and self.conn.exists(keys.batch_key(batch)):
            return job_id, batch, ""
        return None

    def end(self, job: Job, record: ResultRecord) -> bool:
        """Write ``record`` (once) and end the job everywhere. True if this wrote the record."""
        return self.end_many([(job, record)])[0]

    def end_many(self, ended: list[tuple[Job, ResultRecord]]) -> list[bool]:
        """:meth:`end` for several jobs in one round trip."""
        wrote = self._send(
            [
                _Ending(j.id, j.queue, r, j.envelope.result_ttl, j.started.elapsed())
                for j, r in ended
            ]
        )
        for (job, _), w in zip(ended, wrote, strict=True):
            if not w:
                log.info("job %s: a result already existed; kept the first", job.id)
        return wrote

    def _send(self, endings: list[_Ending]) -> list[bool]:
        """``scripts.END`` for each ending, pipelined by SHA; whether each wrote its record.

        Not through the ``Script`` object: a pipeline holding one asks ``SCRIPT EXISTS``
        first, a second round trip on every job's end. If Redis lost the script
        (restarted, flushed), every call fails alike with NOSCRIPT, having done nothing:
        load it and send them again."""
        calls = [self._end_call(e) for e in endings]
        replies = self._pipelined(calls)
        self._released(*(e.job_id for e in endings))
        if any(isinstance(r, NoScriptError) for r in replies):
            self.conn.script_load(scripts.END)
            replies = self._pipelined(calls)
        for r in replies:
            if isinstance(r, Exception):
                raise r
        return [bool(w) for w in replies]

    def _pipelined(self, calls: list[tuple[list[str], list[Any]]]) -> list[Any]:
        with self.conn.pipeline(transaction=False) as pipe:
            for script_keys, args in calls:
                pipe.evalsha(self._end.sha, len(script_keys), *script_keys, *args)
            if not self.wait_replicas:
                return list(pipe.execute(raise_on_error=False))
            wait_for_replicas(pipe, self.wait_replicas)  # on the connection that wrote
            *replies, acked = pipe.execute(raise_on_error=False)
        if isinstance(acked, Exception) or int(acked) < self.wait_replicas:
            self.wait_shortfalls += 1
            log.warning(
                "%s: %d record(s) reached %s of %d replica(s) within %d ms",
                self.name,
                len(calls),
                acked if not isinstance(acked, Exception) else f"? ({acked})",
                self.wait_replicas,
                WAIT_TIMEOUT_MS,
            )
        return replies

    def _end_call(self, e: _Ending) -> tuple[list[str], list[Any]]:
        """The keys and arguments of ``scripts.END`` for one ending."""
        record = e.record
        ok = record is not None and record.status == "succeeded"
        registry = keys.rq_finished_key(e.queue) if ok else keys.rq_failed_key(e.queue)
        exc = e.error or (record.error.message if record and record.error else "")
        if record is not None:
            once_keys, once_args = write_once_call(record, e.ttl)
        else:  # the same script, writing no record
            batch = keys.batch_of(e.job_id)
            once_keys = [
                keys.result_key(e.job_id),
                keys.batch_key(batch),
                keys.batch_done_key(batch),
            ]
            once_args = ["", int(e.ttl), "failed", e.job_id, repr(time.time())]
        return (
            [
                *once_keys,
                *(keys.RUNNING, keys.rq_job_key(e.job_id)),
                *(keys.rq_started_key(e.queue), registry, self.worker_key),
                keys.rq_results_key(e.job_id),
            ],
            [
                *once_args,
                self.token,
                "finished" if ok else "failed",
                rq_time(),
                "successful_job_count" if ok else "failed_job_count",
                round(e.worked, 6),
                base64.b64encode(zlib.compress(exc.encode())).decode() if exc else "",
                self.name,
                ENDED_JOB_DATA if ok else "",
                *_usage(e.queue, record),
            ],
        )

    def peek(self, queue: str, n: int) -> list[ChatRequest | EmbeddingRequest]:
        """The requests of the next ``n`` jobs waiting in ``queue``: read, not taken (jobs
        whose hash does not read are left out; taking them refuses them)."""
        ids = [i.decode() for i in self.conn.lrange(keys.rq_queue_key(queue), 0, n - 1)]
        if not ids:
            return []
        pipe = self.conn.pipeline(transaction=False)
        for job_id in ids:
            pipe.hmget(keys.rq_job_key(job_id), "data", "timeout")
        out = []
        for job_id, (data, timeout) in zip(ids, pipe.execute(), strict=True):
            fields = {k: v for k, v in ((b"data", data), (b"timeout", timeout)) if v is not None}
            try:
                out.append(read_job_hash(job_id, fields).envelope.request)
            except JobRefused:
                continue
        return out

    def waiting(self, queue: str) -> int:
        """How many jobs wait in ``queue`` now, its tenants' lists and their batches' own
        lists included (at most 100 lists of each counted)."""
        base = keys.base_queue(queue)
        lists = {base, *(m.decode() for m in self.conn.zrange(keys.fair_key(base), 0, 99))}
        return sum(lanes.depths(self.conn, sorted(lists)))

    def first_waiting(self, queues: list[str]) -> str | None:
        """The first of ``queues`` that holds a job now, on its own list, a tenant's or a
        batch's (its fair set and ring name the lists with work; one round trip), or None."""
        pipe = self.conn.pipeline(transaction=False)
        for q in queues:
            pipe.llen(keys.rq_queue_key(q))
            pipe.zcard(keys.fair_key(q))
            pipe.llen(keys.ring_key(q))
        found = pipe.execute()
        return next((q for i, q in enumerate(queues) if any(found[3 * i : 3 * i + 3])), None)

    def requeue(self, job: Job) -> bool:
        """Give a held job back to the front of its queue, unstarted."""
        done = self._requeue(job.id, job.queue)
        self._released(job.id)
        return done

    def hand_back_all(self) -> list[str]:
        """Give every job this process holds back to the front of its queue, unstarted,
        with no crash counted: the process cannot go on (its worker group hung) and is
        about to end. Safe from another thread while the main one is stuck. Returns the
        ids handed back."""
        with self._holding_lock:
            held = sorted(self.holding)
        back: list[str] = []
        if not held:
            return back
        for job_id, value in zip(held, self.conn.hmget(keys.RUNNING, held), strict=True):
            token, _, queue = (value or b"").decode().partition(" ")
            if token == self.token and self._requeue(job_id, queue):
                back.append(job_id)
        self._released(*held)
        return back

    def _requeue(self, job_id: str, queue: str) -> bool:
        return bool(
            self.conn.eval(
                scripts.REQUEUE,
                4,
                *(keys.RUNNING, keys.rq_queue_key(queue), keys.rq_job_key(job_id)),
                keys.rq_started_key(queue),
                *(self.token, job_id, queue),
            )
        )


def dead_letter(conn: Redis, job_id: str, reason: str) -> None:
    """Record a job that could not run at all on ``mlxq:dead`` (newest first, capped)."""
    entry = json.dumps({"job_id": job_id, "reason": reason, "at": time.time()})
    with conn.pipeline() as pipe:
        pipe.lpush(keys.DEAD_LETTERS, entry)
        pipe.ltrim(keys.DEAD_LETTERS, 0, keys.DEAD_LETTERS_MAX - 1)
        pipe.execute()
    log.warning("dead-lettered job %s: %s", job_id, reason)


def _ttl(payload: dict[str, Any] | None) -> int:
    ttl = (payload or {}).get("result_ttl")
    return ttl if isinstance(ttl, int) and ttl > 0 else keys.DEFAULT_RESULT_TTL


def _usage(queue: str, record: ResultRecord | None) -> list[Any]:
    """The end script's usage arguments: the day's hash, the tenant, prompt and completion
    tokens ("" for the hash when no record is written)."""
    if record is None:
        return ["", "", 0, 0]
    usage = record.usage  # (an embeddings list's has no completion tokens; a stopped job's)
    prompt = int(getattr(usage, "prompt_tokens", 0) or 0)
    completion = int(getattr(usage, "completion_tokens", 0) or 0)
    day = keys.usage_day(record.finished_at)
    return [keys.usage_key(day), keys.tenant_of(queue), prompt, completion]
