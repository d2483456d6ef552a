"""A lane: one engine, the jobs it decodes (its rows) and their records, nothing else.

One lane per batch key (model, adapter, draft or lookup and k): :meth:`Lane.add` puts a
taken job in (prepared, its places and KV room checked, ``first``: its prompt before the
others'; a row each, n sequences for n choices: ``worker.runner.rows``),
:meth:`Lane.step` steps the engine once and ends the jobs that finished or must stop
(``worker.runner.stops``), :meth:`Lane.remove` takes one out unstarted (preempted),
:meth:`Lane.close` frees its engine and room. What to take, which lane steps and how
much it may prefill are decided by the worker's loop (``worker.runner.lanes``) and the
step rules (``worker.schedule.step``), not here. The KV bytes each live lane's caches can
grow to are counted in one :class:`Ledger` and reserved in the model cache as their sum.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Hashable, Sequence
from contextlib import AbstractContextManager
from typing import Protocol

from schemas import GenerationError, MlxqError, ResultRecord
from schemas.fleet import BatchInfo
from schemas.keys import base_queue
from worker.engine.batch import BatchEngine
from worker.engine.generator import ChatGenerator
from worker.engine.mirror import GroupEngine
from worker.engine.models import ModelCache
from worker.engine.output import GenerationOutput
from worker.engine.protocol import CannotTake, Engine, Finished
from worker.engine.request import Prepared
from worker.engine.specbatch import SpecBatchEngine
from worker.lifecycle.held import Job, Lifecycle
from worker.runner import records
from worker.runner.company import PEEK, company
from worker.runner.images import images_of
from worker.runner.kv import kv_models, projected
from worker.runner.rows import Row, add_choices, remove_choices, tag_owner
from worker.runner.runtime import WorkerRuntime
from worker.runner.stops import Stops
from worker.runner.streamer import JobStream, stream_ended
from worker.schedule.admission import Length, Verdict, admit, places
from worker.schedule.estimators import ewma
from worker.schedule.goodput import Goodput
from worker.schedule.grouping import BatchKey, batchable
from worker.schedule.meter import BatchMeter
from worker.schedule.policy import LOOKUP, Decision
from worker.schedule.route import Route
from worker.schedule.step import leavers, preempt_for_room

log = logging.getLogger(__name__)

#: The reason a lane holds what it holds when its queue has nothing more.
QUEUE_EMPTY = "queue: no more jobs waiting"


class Host(Protocol):
    """What lanes and their turns need from the worker (``worker.runner.loop.Worker``)."""

    rt: WorkerRuntime
    lifecycle: Lifecycle
    max_batch: int | None  # None: auto
    batch: BatchInfo | None  # what the running batch publishes (``producer fleet``)
    queues: list[str]  # first ones first

    def may_take(self) -> bool: ...

    def take_from(self, queue: str, model: str | None = None) -> Job | None: ...

    def run_alone(self, job: Job, r: Route) -> None: ...

    def run_embeddings(self, first: Job) -> None: ...

    def finish(self, ended: list[tuple[Job, ResultRecord]]) -> None: ...

    def computing(self) -> AbstractContextManager[None]: ...


class Ledger:
    """The KV bytes each live lane's caches can grow to; their sum is reserved in the model
    cache (kept prefixes keep out of it). ``version`` counts its changes (a job joined or
    left a lane, a lane closed): a job that could not be placed waits for the next."""

    def __init__(self, cache: ModelCache) -> None:
        self.cache = cache
        self.held: dict[Hashable, int] = {}  # a live lane (or solo) -> the bytes it can grow to
        self.version = 0

    def set(self, lane: Hashable, nbytes: int) -> None:
        self.held[lane] = nbytes
        self.version += 1
        self.cache.reserve(sum(self.held.values()))

    def drop(self, lane: Hashable) -> None:
        if self.held.pop(lane, None) is not None:  # (a lane that never held a job: no change)
            self.version += 1
            self.cache.reserve(sum(self.held.values()))

    def others(self, lane: Hashable) -> int:
        """What the other live lanes' caches can grow to."""
        return sum(n for other, n in self.held.items() if other is not lane)


class Lane:
    """One engine on one batch key, its rows, and the state of taking jobs into it."""

    def __init__(
        self, host: Host, queue: str, key: BatchKey, ledger: Ledger, cap: int, budgeted: bool
    ) -> None:
        self.host, self.queue, self.key, self.ledger = host, queue, key, ledger
        self.rt = host.rt
        self.cap, self.budgeted = cap, budgeted  # budgeted: prefill may be cut per step
        self.rows: dict[str, Row] = {}
        self.generator: ChatGenerator | None = None
        self.engine: Engine | None = None
        self.decision: Decision | None = None  # the first job's: how the policy batched it
        self.draft_named: str | None = None  # the draft the first job named (k left to policy)
        self.meter = BatchMeter(self.rt.policy, key)
        self.stops = Stops(host.lifecycle.conn, self.rt.time_limit_s)  # cancels, time limits
        self.barred = False  # takes nothing more (the engine refused the lane's key)
        self.blocked: int | None = None  # the ledger's version when a job could not be placed
        self.held: tuple[Length, int] | None = None  # (prompt, max_tokens), n: waiting
        self.reason = QUEUE_EMPTY  # why it holds what it holds
        self.projected = 0  # the most its KV caches can grow to (bytes)
        self.kv_bytes = 0  # measured, after the last step
        self.peak_kv_bytes = self.peak_projected_bytes = 0
        self.step_s: float | None = None  # steps' seconds, prefills too (running average)
        self.decode_s: float | None = None  # steps' seconds that only decoded (running)

    def start(self, first_route: Route) -> None:
        """The terms the first job sets: how the policy batched it, the draft it named."""
        self.decision = first_route.decision
        # jobs like the first join on its terms when the policy (not the job) chose them
        fixed = first_route.fixed_k is not None
        self.draft_named = first_route.proposer if not fixed else None

    def size(self) -> int:
        """The sequences the lane holds (a job with n choices holds n)."""
        return sum(r.n for r in self.rows.values())

    def may_take(self) -> bool:
        """Whether the lane may take jobs now: not barred, and the lanes changed since a
        job at the head of its queue could not be placed (FIFO: it goes first)."""
        return not self.barred and self.blocked != self.ledger.version

    def block(self) -> None:
        """A job at the head of the lane's queue went back: take again when lanes change."""
        self.blocked = self.ledger.version

    def limit(self) -> tuple[int, str]:
        """How many sequences the lane may hold now, and why (before memory)."""
        if self.host.max_batch is not None:
            return self.cap, f"cap: --max-batch {self.cap}"
        limit, reason = self.rt.policy.sizes.limit(*self.key)
        return (limit, reason) if limit < self.cap else (self.cap, f"cap: {self.cap} (auto)")

    # -- stepping ---------------------------------------------------------
    def step(self, prefill_budget: int | None = None) -> float:
        """One step of the engine (prefilling at most ``prefill_budget`` prompt tokens,
        when budgeted): jobs that end are ended. Returns its seconds."""
        assert self.engine is not None
        size = self.size()
        self.meter.held(size)
        for row in self.rows.values():
            row.peak = max(row.peak, size)
        if self.budgeted and isinstance(self.engine, (BatchEngine, SpecBatchEngine)):
            self.engine.prefill_budget = prefill_budget
        t = time.perf_counter()
        with self.host.computing():
            step = self.engine.step()
        seconds = time.perf_counter() - t
        self.kv_bytes = kv = self.engine.kv_bytes
        self.peak_kv_bytes = max(self.peak_kv_bytes, kv)
        self._finish_outputs(step.done)
        self._expire()
        self.meter.step(step.sequences, step.tokens, seconds, step.prefilled)
        self.step_s = ewma(self.step_s, seconds)  # what a token here waits, prefills too
        if not step.prefilled:
            self.decode_s = ewma(self.decode_s, seconds)
        return seconds

    def close(self, requeue: bool = False) -> None:
        """The lane has ended (``requeue``: jobs still in it go back to their queues): its
        engine closes, its KV room is free, what it measured is counted."""
        if requeue:
            for row in self.drain():
                self.host.lifecycle.requeue(row.job)
        self.ledger.drop(self)
        if self.engine is not None:
            self.engine.close()
        peaks = (self.meter.peak_size, self.peak_kv_bytes, self.peak_projected_bytes)
        self.rt.stats.add_batch(*peaks)
        log.info("lane on %s ended: %d jobs, KV %d B, projected %d B", self.key.model, *peaks)

    def drain(self) -> list[Row]:
        """Every job still in the lane (the lane is empty afterwards)."""
        rows, self.rows = list(self.rows.values()), {}
        return rows

    def fail_all(self, e: Exception) -> None:
        """The lane failed: every job in it fails, naming why."""
        error, rows = GenerationError(f"{type(e).__name__}: {e}"), self.drain()
        self.end([(r.job, records.failure(r.job, self.rt, error)) for r in rows], rows)

    def remove(self, row: Row) -> None:
        """Take ``row``'s job out, back to the front of its queue unstarted (preempted)."""
        remove_choices(self.engine, row)
        del self.rows[row.job.id]
        self.host.lifecycle.requeue(row.job)
        self.rt.stats.preemptions += 1
        self._reserve()
        log.info("job %s preempted for a job ahead; back in %s", row.job.id, self.queue)

    # -- taking jobs ------------------------------------------------------
    def again(self, job: Job) -> bool:
        """True if ``job`` decodes in this lane already: taken again (its lease here was
        counted lost, say across a Sentinel failover). The run goes on under the new take
        (a second sequence with the same id would end it twice and fail the lane)."""
        row = self.rows.get(job.id)
        if row is None:
            return False
        log.warning("job %s was taken again while it runs in this batch; it runs on", job.id)
        row.job = job
        return True

    def add(
        self,
        job: Job,
        r: Route,
        first: bool = False,
        between: Callable[[], None] | None = None,
        keep: int | None = None,
    ) -> bool:
        """Put ``job`` into the lane (True; ``first``: its prompt prefills before those
        of jobs still waiting to prefill; ``between``: called between two chunks of a
        shared prefix prefilled to keep; ``keep``: own rows that stay when others give
        their places up for its memory, None: it waits for memory instead); hand it back
        to wait for memory, or end it at once with what stops it (False)."""
        req = job.envelope.request
        conn = self.host.lifecycle.conn
        try:
            self.rt.check_request(req)  # the draft too: batched without it, but named
            with self.host.computing():
                engine = self._engine()
            assert self.generator is not None
            images = images_of(conn, job, self.rt.image_hosts)
            prepared = self.generator.prepare(self.rt.with_defaults(req), images=images)
            if not self._room_for(job, prepared, keep, req.n):
                return False
            if req.n > 1:
                with self.host.computing():
                    add_choices(engine, self.generator, job.id, prepared, req.n, first)
                return self._joined(Row(job, r, n=req.n))
            upcoming = functools.partial(self.host.lifecycle.peek, job.queue, PEEK)
            others = company(self.generator, prepared, upcoming, self.rt.scout)
            with self.host.computing():  # a shared prefix not kept yet is prefilled once here
                draft = self.generator.draft if self.key.draft else None
                held = len(prepared.prompt) - 1
                start = self.generator.starting_cache(prepared, held, draft, others, between)
            stream = JobStream(conn, job, self.generator.target, prepared) if req.stream else None
            with self.host.computing():
                engine.add(job.id, prepared, start, stream and stream.streamer, first=first)
        except CannotTake as e:
            self._cannot_take(job, str(e))
            return False
        except MlxqError as e:
            self.end([(job, records.failure(job, self.rt, e))])
            return False
        except Exception as e:  # never let one job's surprise take the lane down
            log.exception("job %s could not join the batch", job.id)
            error = GenerationError(f"{type(e).__name__}: {e}")
            self.end([(job, records.failure(job, self.rt, error))])
            return False
        return self._joined(Row(job, r, stream=stream))

    def _joined(self, row: Row) -> bool:
        self.rows[row.job.id] = row
        self._reserve()
        return True

    def _cannot_take(self, job: Job, reason: str) -> None:
        """The engine cannot hold ``job``. A speculative lane's refusal bars the pair from
        speculative batches and gives the job back to the front of its queue, to run
        another way; any other engine's refusal fails the job, naming why."""
        if self.key.draft is None:
            self.end([(job, records.failure(job, self.rt, GenerationError(reason)))])
            return
        log.warning("job %s: %s; %s runs its draft jobs another way", job.id, reason, self.key[0])
        self.rt.policy.refuse_spec_batch(self.key.model, self.key.draft, reason)
        self.host.lifecycle.requeue(job)
        self.barred = True  # nothing more joins: the lane's key is barred now
        self.reason = f"refused: {reason}"

    def _room_for(self, job: Job, prepared: Prepared, keep: int | None, n: int = 1) -> bool:
        """Whether the lane has places and KV memory for ``job`` (``n`` choices) now. If
        nothing else runs, make room (kept prefixes go) or raise ContextTooLargeError; if
        others run and it does not fit, own rows give their places up (``keep`` stay:
        ``step.preempt_for_room``) or it goes back to the front of its queue to wait."""
        length = prepared.length()
        alone = self.peak([length] * n)
        self.rt.cache.check_kv_fits(alone, prepared.label)  # one that never fits fails now
        beside = self.ledger.others(self)
        if not self.rows and not beside:
            self.rt.cache.make_kv_room(alone, prepared.label)
            return True
        if not self.rows:  # beside another lane: it waits for room there is not
            if not self.rt.cache.fits_beside(alone):
                self.host.lifecycle.requeue(job)
                self.block()
                return False
            self.rt.cache.make_kv_room(beside + alone, prepared.label)
            return True
        verdict = self.admission(length, n)
        if not verdict.join and verdict.over and keep is not None:
            rows, freed = evictable(self, keep, [length] * n)
            for row in rows[: preempt_for_room(verdict.over, freed) or 0]:
                self.remove(row)
            verdict = self.admission(length, n)
        if verdict.join:
            return True
        self.host.lifecycle.requeue(job)
        self.held, self.reason = (length, n), verdict.reason
        return False

    # -- memory -----------------------------------------------------------
    def room(self) -> int:
        return self.rt.cache.kv_room() - self.ledger.others(self)

    def admission(self, length: Length, n: int = 1) -> Verdict:
        """The scheduler's verdict on a job of ``length`` (``n`` choices) joining the lane
        now: its places (``admission.places``), then its memory (``admission.admit``)."""
        assert self.engine is not None
        if not (verdict := places(self.size(), n, *self.limit())).join:
            return verdict
        return admit(self.peak, list(self.engine.lengths().values()), length, self.room(), n)

    def peak(self, sequences: Sequence[Length]) -> int:
        """The most the lane's KV caches can hold for ``sequences`` (the draft's too)."""
        assert self.engine is not None and self.generator is not None
        return projected(kv_models(self.engine, self.generator), sequences)

    def _reserve(self) -> None:
        """Count what the lane's KV caches can grow to in the ledger."""
        assert self.engine is not None
        self.projected = self.peak(list(self.engine.lengths().values()))
        self.peak_projected_bytes = max(self.peak_projected_bytes, self.projected)
        self.ledger.set(self, self.projected)

    def _engine(self) -> Engine:
        if self.engine is None:
            budget = 0 if self.budgeted else None  # (the least chunks until a speed is known)
            self.generator, self.engine = _make_engine(self.rt, self.key, self.cap, budget)
        return self.engine

    # -- ending jobs ------------------------------------------------------
    def end(self, ended: list[tuple[Job, ResultRecord]], rows: Sequence[Row] = ()) -> None:
        """End jobs with their records, then streamed ones' final (or error) chunks."""
        if ended:
            self.host.finish(ended)
            streams = {r.job.id: r.stream for r in rows}
            for job, record in ended:
                stream_ended(self.host.lifecycle.conn, job, record, streams.get(job.id))

    def _finish_outputs(self, done: list[Finished]) -> None:
        """Jobs whose every choice ended are ended; a choice that failed fails its job
        (its other choices leave the engine)."""
        ended, rows = [], []
        assert self.generator is not None and self.engine is not None
        for tag, out in done:
            job_id, i = tag_owner(str(tag))
            row = self.rows.get(job_id)
            if row is None:  # (never expected: one sequence per job, see again)
                log.error("batch output for job %s, which it does not hold; dropped", job_id)
                continue
            if isinstance(out, MlxqError):
                remove_choices(self.engine, row, but=i)
                ended.append((row.job, records.failure(row.job, self.rt, out)))
            elif (whole := row.took(i, out)) is not None:
                ended.append((row.job, _success(row, self.rt, whole, self.generator)))
            else:
                continue
            rows.append(self.rows.pop(job_id))
        if ended:
            self._reserve()
        self.end(ended, rows)

    def _expire(self) -> None:
        """Jobs that must stop (a cancel, a time limit: ``worker.runner.stops``) leave the
        lane now, each with one record of what it made."""
        due = self.stops.due(r.job for r in self.rows.values())
        if not due:
            return
        assert self.engine is not None
        ended, rows = [], []
        for job, error in due:
            row = self.rows.pop(job.id)
            rows.append(row)
            cut = remove_choices(self.engine, row)
            record = records.stopped(job, self.rt, error, cut, batched_with=row.peak)
            log.info("job %s stopped in the batch on %s: %s", job.id, self.key.model, error.code)
            ended.append((job, record))
        self._reserve()
        self.end(ended, rows)


def mine(row: Row, queue: str) -> bool:
    """Whether ``row`` is a job of ``queue`` that may give its place up (not streamed: a
    stream cannot start over unseen by its reader)."""
    return base_queue(row.job.queue) == queue and row.stream is None


def same_kind(lane: Lane, job: Job, r: Route) -> bool:
    """Whether ``job`` is like the draft jobs ``lane`` was started for (k left to the
    policy): it joins on the lane's terms, so a batch is not starved when the policy
    changes its mind mid-batch."""
    req = job.envelope.request
    return (
        lane.decision is not None
        and lane.draft_named is not None
        and r.proposer == lane.draft_named
        and r.fixed_k is None
        and (req.model, req.adapter) == (lane.key.model, lane.key.adapter)
        and batchable(req, r.proposer)
    )


def evictable(lane: Lane, keep: int, joining: Sequence[Length] = ()) -> tuple[list[Row], list[int]]:
    """The rows of ``lane``'s own queue that may give their places up (:func:`mine`),
    joined last first (the first ``keep`` stay), and what its projected KV shrinks by as
    they leave, one more each time (with ``joining`` in it: a job's sequences that would
    join)."""
    assert lane.engine is not None
    held = list(lane.rows.values())
    rows = [held[i] for i in leavers([mine(r, lane.queue) for r in held], keep)]
    left = lane.engine.lengths()
    base, freed = lane.peak([*left.values(), *joining]), []
    for row in rows:
        for tag in row.tags():
            left.pop(tag, None)
        freed.append(base - lane.peak([*left.values(), *joining]))
    return rows, freed


def _success(
    row: Row, rt: WorkerRuntime, out: GenerationOutput, gen: ChatGenerator
) -> ResultRecord:
    """A finished row's record (a streamed job's parsed as its chunks were)."""
    s = row.stream
    return records.success(
        *(row.job, rt, out, gen),
        completion_id=s.completion_id if s else None,
        batched_with=row.peak,
        route=row.route,
        parser=s.streamer.parser if s else None,
    )


def _make_engine(
    rt: WorkerRuntime, key: BatchKey, cap: int, budget: int | None
) -> tuple[ChatGenerator, Engine]:
    """The generator and engine of a lane on ``key``: a speculative batch with a draft
    or lookup, else a plain one; mirrored on every rank in a worker group."""
    model, adapter, draft, k, adaptive = key
    named = draft if draft != LOOKUP else None  # a draft model to load
    generator = ChatGenerator.get_or_create(model, named, adapter, cache=rt.cache)
    engine: Engine
    if draft is not None:
        planner = Goodput(k, rt.policy.acceptance(model, draft)) if adaptive else None
        engine = SpecBatchEngine(
            generator.target,
            generator.draft,
            k,
            planner,
            prefill_budget=budget,
            drafter=generator.drafter,
        )
    else:
        engine = BatchEngine(generator.target, cap, prefill_budget=budget)
    if (group := rt.cache.group) is not None:  # mirrored on every rank
        engine = GroupEngine(group, engine, generator.target)
    return generator, engine
