"""Continuous batching of jobs: while a batch runs, the worker keeps taking jobs into it.

A job whose route (``worker.schedule.route``) names a batch runs a :class:`ContinuousBatch`:
further jobs of its queue on the same (model, adapter, draft or lookup, k) join, also
while it runs (a freed slot is filled at the next step), decoded by ``worker.engine.batch``
or, with a draft, ``worker.engine.specbatch``. Memory admits each joiner (the KV bytes the
batch can grow to; one that does not fit waits at the front of its queue, first in first
out), ``--max-batch auto`` grows the batch while a larger one measures faster, and a job
that cannot join goes back to the front of its queue.

Queues served before the batch's (``mlxq.interactive``) are looked at between steps: a job
there joins the batch, runs in a *side batch* beside it, runs alone between two steps, or
waits for the batch to end; the rules (join or beside, a place at the cap, the prefill
budget, the time share of jobs beside) are ``worker.schedule.step``'s, pure, with their
constants in ``WorkerRuntime.step``; docs/worker.md tells them with their reasons. Jobs are
taken, ended and given back through ``worker.lifecycle.held``; a job that must stop (a
cancel, a time limit) leaves at the next step (``worker.runner.stops``).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Protocol

from redis.exceptions import RedisError

from schemas import ChatRequest, GenerationError, MlxqError, ResultRecord, keys
from schemas.fleet import BatchInfo
from worker.engine.batch import BatchEngine
from worker.engine.generator import ChatGenerator
from worker.engine.mirror import GroupEngine
from worker.engine.protocol import CannotTake, Engine, Finished
from worker.engine.request import Prepared
from worker.engine.specbatch import SpecBatchEngine
from worker.lifecycle.held import Job, Lifecycle
from worker.runner import records
from worker.runner.alone import kv_need
from worker.runner.company import PEEK, company
from worker.runner.embedjobs import is_embedding
from worker.runner.images import images_of
from worker.runner.kv import projected
from worker.runner.runtime import WorkerRuntime
from worker.runner.stops import Stops
from worker.schedule.admission import Length, Verdict, admit
from worker.schedule.estimators import ewma
from worker.schedule.goodput import Goodput
from worker.schedule.grouping import BatchKey, batchable
from worker.schedule.meter import BatchMeter
from worker.schedule.policy import LOOKUP, Decision
from worker.schedule.route import Route, route
from worker.schedule.step import (
    BatchView,
    joins,
    owed_after_alone,
    owed_after_step,
    place_for_one,
    prefill_budget,
)

log = logging.getLogger(__name__)

#: Seconds a batch stops taking jobs after one could not join (FIFO: it waits first).
PAUSE_AFTER_HAND_BACK_S = 1.0
#: Seconds between two updates of the batch state the worker publishes.
PUBLISH_EVERY_S = 0.5
#: The reason a batch holds what it holds when its queue has nothing more.
QUEUE_EMPTY = "queue: no more jobs waiting"
#: The most sequences one batch holds under ``--max-batch auto``.
AUTO_CAP = 256
#: Seconds between two looks at the queues served before the batch's.
LOOK_EVERY_S = 0.1
#: The rules between steps (join or beside, a place at the cap, the prefill budget, the
#: time share) and their constants: ``worker.schedule.step`` (``WorkerRuntime.step``).


class Host(Protocol):
    """What a batch needs from the worker that runs it (``worker.runner.loop.Worker``)."""

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


@dataclass
class _Slot:
    job: Job
    route: Route
    peak: int = 1  # the most jobs decoding together while this one ran


class ContinuousBatch:
    """One continuous batch for (model, adapter), run on behalf of a worker."""

    def __init__(
        self,
        host: Host,
        queue: str,
        key: BatchKey,
        depth: int = 1,
        main: ContinuousBatch | None = None,
    ) -> None:
        self.host, self.queue, self.key, self.depth = host, queue, key, depth
        #: A side batch's: the batch it runs beside, which steps it (None: a batch).
        self.main = main
        #: The side batch of jobs from queues ahead that runs beside this one, if any.
        self.side: ContinuousBatch | None = None
        self.rt = host.rt
        self.cap = host.max_batch or AUTO_CAP
        self.slots: dict[str, _Slot] = {}
        self.generator: ChatGenerator | None = None
        self.engine: Engine | None = None
        self.decision: Decision | None = None  # the first job's: how the policy batched it
        self.draft_named: str | None = None  # the draft the first job named (k left to policy)
        self.meter = BatchMeter(self.rt.policy, key)
        self.cfg = self.rt.step  # the step rules' constants
        self.stops = Stops(host.lifecycle.conn, self.rt.time_limit_s)  # cancels, time limits
        self._pause_until = 0.0
        self._held: Length | None = None  # (prompt, max_tokens) waiting for memory
        self._reason = QUEUE_EMPTY
        self._projected = 0  # the most the batch's KV caches can grow to (bytes)
        self._kv_bytes = 0  # measured, after the last step
        self.peak_kv_bytes = 0
        self.peak_projected_bytes = 0
        self._published_at = -PUBLISH_EVERY_S
        # the queues served before this batch's, and when to look at them next
        before = host.queues.index(queue) if queue in host.queues else 0
        self.ahead = host.queues[:before] if main is None else []  # (the batch looks)
        self._look_at = 0.0
        self._owed = 0.0  # step seconds the batch is owed by jobs run alone (< 0: banked)
        self._step_s: float | None = None  # steps' seconds, prefills too (running average)
        self._decode_s: float | None = None  # steps' seconds that only decoded (running)
        # someone may wait for the next step: prefill is cut to fit (not in a group)
        self._budgeted = bool(self.ahead) and self.rt.cache.group is None
        self._seen_ahead = -float("inf")  # when a job was last seen waiting ahead
        self._joining = False  # inside a join (a kept prefix prefilling): none may join now
        self._chunk_at = 0.0  # when the last chunk of such a prefill ended

    @property
    def peak_size(self) -> int:
        return self.meter.peak_size

    def run(self, first: Job, first_route: Route) -> None:
        """Decode ``first`` (routed to this batch) and every job that joins until the batch
        is empty (and the side batch beside it, if one opened).

        A BaseException (a cold shutdown) gives every job still in the batch back
        to its queue; an unexpected error fails them.
        """
        self._start(first_route)
        try:
            self._admit(first, first_route)
            self._fill()  # the queued companions join before the first step
            while self.slots or self.side is not None:
                if self.slots:
                    seconds = self._step()
                    self._owed = owed_after_step(self._owed, seconds, self.cfg)
                self._urgent()
                self._step_side()
                self._fill()
                self._publish()
            self.meter.close()
        except Exception as e:
            log.exception("batch on %s failed; failing its %d job(s)", self.key[0], len(self.slots))
            error = GenerationError(f"{type(e).__name__}: {e}")
            self._end([(s.job, records.failure(s.job, self.rt, error)) for s in self._drain()])
        except BaseException:
            for slot in self._drain():
                self.host.lifecycle.requeue(slot.job)
            raise
        finally:
            if self.side is not None:  # (the batch failed beside it: its jobs run later)
                self.side._close(requeue=True)
            self.host.batch = None
            self._close()

    def _start(self, first_route: Route) -> None:
        """The terms the first job sets: how the policy batched it, the draft it named."""
        self.decision = first_route.decision
        # jobs like the first join on its terms when the policy (not the job) chose them
        fixed = first_route.fixed_k is not None
        self.draft_named = first_route.proposer if not fixed else None

    def _step(self) -> float:
        """One step of the engine: jobs that end are ended. Returns its seconds."""
        assert self.engine is not None
        size = len(self.slots)
        self.meter.held(size)
        for slot in self.slots.values():
            slot.peak = max(slot.peak, size)
        if self._budgeted and isinstance(self.engine, BatchEngine):
            self.engine.prefill_budget_s = prefill_budget(self._view(), self.cfg)
        t = time.perf_counter()
        with self.host.computing():
            step = self.engine.step()
        seconds = time.perf_counter() - t
        self._kv_bytes = self.engine.kv_bytes
        self.peak_kv_bytes = max(self.peak_kv_bytes, self._kv_bytes)
        self._finish_outputs(step.done)
        self._expire()
        self.meter.step(step.sequences, step.tokens, seconds, step.prefilled)
        # what a token of a job in this batch waits, prefill chunks included
        self._step_s = ewma(self._step_s, seconds)
        if not step.prefilled:
            self._decode_s = ewma(self._decode_s, seconds)
        return seconds

    def _close(self, requeue: bool = False) -> None:
        """The batch has ended (``requeue``: jobs still in it go back to their queues): its
        engine closes, its KV room is free, what it measured is counted."""
        if requeue:
            for slot in self._drain():
                self.host.lifecycle.requeue(slot.job)
        if self.main is not None:  # a side batch: the batch beside it holds its room
            self.main.side = None
            self.main._reserve()
        else:
            self.rt.cache.release()
        if self.engine is not None:
            self.engine.close()
        self.rt.stats.add_batch(self.peak_size, self.peak_kv_bytes, self.peak_projected_bytes)
        log.info(
            "%s on %s ended: up to %d jobs, KV %.1f MB (projected up to %.1f MB)",
            "batch" if self.main is None else "side batch",
            self.key[0],
            self.peak_size,
            self.peak_kv_bytes / 1e6,
            self.peak_projected_bytes / 1e6,
        )

    def _drain(self) -> list[_Slot]:
        """Every job still in the batch (the batch is empty afterwards)."""
        slots, self.slots = list(self.slots.values()), {}
        return slots

    # -- taking jobs ------------------------------------------------------
    def _limit(self) -> tuple[int, str]:
        """How many jobs the batch may hold now, and why (before memory)."""
        if self.host.max_batch is not None:
            return self.cap, f"cap: --max-batch {self.cap}"
        limit, reason = self.rt.policy.sizes.limit(*self.key)
        return (limit, reason) if limit < self.cap else (self.cap, f"cap: {self.cap} (auto)")

    def _fill(self) -> None:
        while time.monotonic() >= self._pause_until:
            limit, reason = self._limit()
            if len(self.slots) >= limit:
                self._reason = reason
                return
            if self._held is not None:
                if not self._admission(self._held).join:
                    return  # the job at the head waits for room; nothing overtakes it
                self._held = None
            job = self.host.take_from(self.queue, self.key.model)  # its model's first
            if job is None:
                self._reason = QUEUE_EMPTY
                return
            if self._again(job):
                continue
            if is_embedding(job):  # embedded after the batch, with its like
                self.host.lifecycle.requeue(job)
                self._pause_until = time.monotonic() + PAUSE_AFTER_HAND_BACK_S
                return
            depth = max(self.depth, len(self.slots) + 1)
            r = route(job.envelope.request, self.rt.policy, depth, decide_alone=False)
            if r.batch != self.key and self._same_kind(job, r):
                # the policy's new mind is for the next batch
                r = dataclasses.replace(r, batch=self.key, decision=self.decision)
            if r.batch != self.key:
                self.host.lifecycle.requeue(job)
                self._pause_until = time.monotonic() + PAUSE_AFTER_HAND_BACK_S
                return
            if not self._admit(job, r):
                return

    # -- interactive jobs -------------------------------------------------
    def _between_chunks(self) -> None:
        """Between two chunks of a shared prefix prefilled as a job joins: that prefill is
        the batch's work, paid to it as a step's, and waiting jobs may run alone."""
        now = time.perf_counter()
        self._owed = owed_after_step(self._owed, now - self._chunk_at, self.cfg)
        self._joining = True
        try:
            self._urgent()
            self._step_side()
        finally:
            self._joining = False
            self._chunk_at = time.perf_counter()

    def _urgent(self) -> None:
        """Jobs waiting in the queues served before the batch's: they join it, or run alone
        between two steps, or (neither possible) wait for the batch to end."""
        if not self.ahead or time.monotonic() < self._look_at or not self.host.may_take():
            return  # a stopping worker takes nothing, so looks at nothing
        if self._owed > 0:
            return  # the batch steps first: jobs run alone took their share
        self._look_at = time.monotonic() + LOOK_EVERY_S
        while (queue := self._first_waiting()) is not None:
            self._seen_ahead = time.monotonic()
            job = self.host.take_from(queue)
            if job is None or not self._urgent_one(job):
                return

    def _view(self) -> BatchView:
        """What the step rules (``worker.schedule.step``) read of this batch now."""
        own = sum(keys.base_queue(s.job.queue) == self.queue for s in self.slots.values())
        smallest = self.rt.policy.sizes.smallest_step_s(*self.key, most=self.cfg.small_size)
        return BatchView(
            size=len(self.slots),
            cap=self.cap,
            own=own,
            step_s=self._step_s,
            decode_s=self._decode_s,
            smallest_step_s=smallest,
            prefill_steps=self.engine.prefill_steps if self.engine is not None else 0,
            in_group=self.rt.cache.group is not None,
            beside=len(self.side.slots) if self.side is not None else 0,
            since_ahead_s=time.monotonic() - self._seen_ahead,
        )

    def _urgent_embeddings(self, job: Job) -> bool:
        """An embedding job from a queue ahead: embedded between two steps when its model
        is loaded (loading one could evict the batch's), else after the batch."""
        if (job.envelope.request.model, None) not in self.rt.cache:
            self.host.lifecycle.requeue(job)
            self._look_at = time.monotonic() + PAUSE_AFTER_HAND_BACK_S
            return False
        t = time.monotonic()
        self.host.run_embeddings(job)
        return self._ran_alone(time.monotonic() - t)

    def _ran_alone(self, took: float) -> bool:
        """A job ran alone between two steps for ``took`` seconds: the batch is owed its
        share of that. Whether the next one may run at once (nothing owed)."""
        self._owed = owed_after_alone(self._owed, took, self.cfg)
        return self._owed <= 0

    def _first_waiting(self) -> str | None:
        """The first queue ahead that holds a job; None too when Redis does not answer (the
        batch's own jobs need Redis only at their end, and are not failed by a look)."""
        try:
            return self.host.lifecycle.first_waiting(self.ahead)
        except RedisError as e:
            log.warning("could not look at %s (%s); looking again later", self.ahead, e)
            self._look_at = time.monotonic() + PAUSE_AFTER_HAND_BACK_S
            return None

    def _urgent_one(self, job: Job) -> bool:
        """Run ``job`` from a queue ahead of the batch's: True when the next may come now
        (it joined, ended at once, or ran alone with the batch owed nothing), False when
        the batch steps first (it went back to wait, or the batch is owed its share)."""
        if self._again(job) or (self.side is not None and self.side._again(job)):
            return True
        if is_embedding(job):
            return self._urgent_embeddings(job)
        req = job.envelope.request
        assert isinstance(req, ChatRequest)
        depth = max(self.depth, len(self.slots) + 1)
        r = route(req, self.rt.policy, depth, decide_alone=False)
        if r.batch != self.key and self._same_kind(job, r):
            r = dataclasses.replace(r, batch=self.key, decision=self.decision)
        joinable = r.batch == self.key and not self._joining
        if joinable and self._join_pays() and self._place_for_one():
            self._admit(job, r, first=True)
            return True
        alone = route(req, self.rt.policy, batching=False)
        need = kv_need(job, alone, self.rt, self.host.lifecycle.conn)
        if need is not None and self._beside_pays(r) and self.rt.cache.fits_beside(need):
            return self._to_side(job, r)
        if need is None or not self.rt.cache.fits_beside(need):
            if joinable and self._place_for_one():  # slower than alone, sooner than waiting
                self._admit(job, r, first=True)
                return True
            self.host.lifecycle.requeue(job)  # first in its queue still: after the batch
            self._look_at = time.monotonic() + PAUSE_AFTER_HAND_BACK_S
            log.info("job %s waits for the batch on %s to end", job.id, self.key.model)
            return False
        t = time.monotonic()
        self.host.run_alone(job, alone)
        return self._ran_alone(time.monotonic() - t)

    def _beside_pays(self, r: Route) -> bool:
        """Whether a job routed ``r`` (it could not join) runs in the side batch: it can be
        batched, and the side batch is for its batch's key (or none runs yet). Not in a
        worker group, whose ranks mirror one engine."""
        if r.batch is None or self.rt.cache.group is not None:
            return False
        return self.side is None or self.side.key == r.batch

    def _to_side(self, job: Job, r: Route) -> bool:
        """Put ``job`` into the side batch (opened for it if none runs): True when the next
        job may come now, False when it went back to wait for room."""
        assert r.batch is not None
        if self.side is None:
            self.side = ContinuousBatch(self.host, keys.base_queue(job.queue), r.batch, main=self)
            self.side._start(r)
        side = self.side
        limit, _ = side._limit()
        if len(side.slots) < limit and side._admit(job, r, first=True):
            return True
        if len(side.slots) >= limit:
            self.host.lifecycle.requeue(job)  # the side batch takes it when a slot frees
        if not side.slots:
            side._close()
        self._look_at = time.monotonic() + PAUSE_AFTER_HAND_BACK_S
        return False

    def _step_side(self) -> None:
        """Steps of the side batch: while the batch is owed nothing (its jobs take at most
        ``urgent_share`` of the time, as jobs run alone), or always while the batch
        holds no job (one step at a time: it may take jobs again). A side batch that fails
        fails its own jobs, not the batch's."""
        while (side := self.side) is not None:
            if not side.slots:
                side.meter.close()
                side._close()
                return
            bound = bool(self.slots) or self._joining
            if bound and self._owed > 0:
                return
            t = time.perf_counter()
            try:
                side._step()
                side._fill()
            except Exception as e:
                log.exception("side batch on %s failed; failing its job(s)", side.key[0])
                error = GenerationError(f"{type(e).__name__}: {e}")
                self._end([(s.job, records.failure(s.job, self.rt, error)) for s in side._drain()])
                side._close()
                return
            except BaseException:
                side._close(requeue=True)
                raise
            if not bound:
                return  # one step: the batch may take its own jobs again
            self._ran_alone(time.perf_counter() - t)

    def _join_pays(self) -> bool:
        """Whether an interactive job joins this batch (``worker.schedule.step.joins``)."""
        return joins(self._view(), self.cfg)

    def _place_for_one(self) -> bool:
        """Whether an interactive job may join now (``worker.schedule.step.place_for_one``).
        Under ``--max-batch auto`` it joins above the size measured fastest (a preference,
        not a cap: memory still decides, in :meth:`_admit`); at the cap the batch job that
        joined last gives its place up."""
        place = place_for_one(self._view(), self.cfg)
        if place == "preempt":
            own = [s for s in self.slots.values() if keys.base_queue(s.job.queue) == self.queue]
            self._preempt(own[-1])  # the last to join: the least work lost
        return place != "full"

    def _preempt(self, slot: _Slot) -> None:
        """Take ``slot``'s job out of the batch, back to the front of its queue unstarted."""
        assert self.engine is not None
        job_id = slot.job.id
        self.engine.remove(job_id)
        del self.slots[job_id]
        self.host.lifecycle.requeue(slot.job)
        self.rt.stats.preemptions += 1
        self._reserve()
        log.info("job %s preempted for an interactive job; back in %s", job_id, self.queue)

    def _same_kind(self, job: Job, r: Route) -> bool:
        """Whether ``job`` is like the draft jobs this batch was started for, which the
        policy decided how to batch (not the job: it leaves k to the policy): it joins
        on the batch's terms until the queue runs dry, so a batch (and what the policy
        measures of it) is not starved when the policy changes its mind mid-batch."""
        req = job.envelope.request
        return (
            self.decision is not None
            and self.draft_named is not None
            and r.proposer == self.draft_named
            and r.fixed_k is None
            and (req.model, req.adapter) == (self.key.model, self.key.adapter)
            and batchable(req)
        )

    def _again(self, job: Job) -> bool:
        """True if ``job`` decodes in this batch already: it was taken again (its lease
        here was counted lost, say across a Sentinel failover, and it was requeued, then
        taken by this worker). The run here goes on under the new take; a second
        sequence with the same id would end it twice and fail the batch."""
        slot = self.slots.get(job.id)
        if slot is None:
            return False
        log.warning("job %s was taken again while it runs in this batch; it runs on", job.id)
        slot.job = job
        return True

    def _admit(self, job: Job, r: Route, first: bool = False) -> bool:
        """Put ``job`` into the batch (True; ``first``: its prompt prefills before those
        of batch jobs still waiting); hand it back to wait for memory, or end it at once
        with what stops it (False)."""
        req = job.envelope.request
        try:
            self.rt.check_request(req)  # the draft too: batched without it, but named
            with self.host.computing():
                engine = self._engine()
            assert self.generator is not None
            prepared = self.generator.prepare(
                req, images=images_of(self.host.lifecycle.conn, job, self.rt.image_hosts)
            )
            if not self._room_for(job, prepared):
                return False
            upcoming = functools.partial(self.host.lifecycle.peek, job.queue, PEEK)
            others = company(self.generator, prepared, upcoming, self.rt.scout)
            with self.host.computing():  # a shared prefix not kept yet is prefilled once here
                draft = self.generator.draft if self.key.draft else None
                held = len(prepared.prompt) - 1
                between = self._between_chunks if self._budgeted and not first else None
                self._chunk_at = time.perf_counter()
                start = self.generator.starting_cache(prepared, held, draft, others, between)
            with self.host.computing():
                engine.add(job.id, prepared, start, first=first)
        except CannotTake as e:
            self._cannot_take(job, str(e))
            return False
        except MlxqError as e:
            self._end([(job, records.failure(job, self.rt, e))])
            return False
        except Exception as e:  # never let one job's surprise take the batch down
            log.exception("job %s could not join the batch", job.id)
            error = GenerationError(f"{type(e).__name__}: {e}")
            self._end([(job, records.failure(job, self.rt, error))])
            return False
        self.slots[job.id] = _Slot(job, r)
        self._reserve()
        return True

    def _cannot_take(self, job: Job, reason: str) -> None:
        """The engine cannot hold ``job``. A speculative batch's refusal bars the pair from
        speculative batches (the policy runs its jobs alone, or batched without the draft)
        and gives the job back to the front of its queue, to be taken on those terms; any
        other engine's refusal fails the job, naming why. Either way it has a path."""
        if self.key.draft is None:
            self._end([(job, records.failure(job, self.rt, GenerationError(reason)))])
            return
        log.warning("job %s: %s; %s runs its draft jobs another way", job.id, reason, self.key[0])
        self.rt.policy.refuse_spec_batch(self.key.model, self.key.draft, reason)
        self.host.lifecycle.requeue(job)
        self._pause_until = float("inf")  # nothing more joins: the batch's key is barred now
        self._reason = f"refused: {reason}"

    def _room_for(self, job: Job, prepared: Prepared) -> bool:
        """Whether the batch has KV memory for ``job`` now. If it is the only job, make
        room (kept prefixes go) or raise ContextTooLargeError; if others run and it does
        not fit, hand it back to the front of its queue to wait."""
        length = prepared.length()
        alone = self._peak([length])
        self.rt.cache.check_kv_fits(alone, prepared.label)  # one that never fits fails now
        beside = self._beside_bytes()
        if not self.slots and not beside:
            self.rt.cache.make_kv_room(alone, prepared.label)
            return True
        if not self.slots:  # beside another batch: it waits for room there is not
            if not self.rt.cache.fits_beside(alone):
                self.host.lifecycle.requeue(job)
                self._pause_until = time.monotonic() + PAUSE_AFTER_HAND_BACK_S
                return False
            self.rt.cache.make_kv_room(beside + alone, prepared.label)
            return True
        verdict = self._admission(length)
        if verdict.join:
            return True
        self.host.lifecycle.requeue(job)
        self._held, self._reason = length, verdict.reason
        return False

    def _room(self) -> int:
        return self.rt.cache.kv_room() - self._beside_bytes()

    def _beside_bytes(self) -> int:
        """What the batch beside this one (its side batch, or the batch it is beside) can
        grow its KV caches to."""
        other = self.side if self.main is None else self.main
        return other._projected if other is not None else 0

    def _admission(self, length: Length) -> Verdict:
        """The scheduler's verdict on a job of ``length`` joining the batch now."""
        assert self.engine is not None
        return admit(self._peak, self.engine.lengths(), length, self._room())

    def _peak(self, sequences: Sequence[Length]) -> int:
        """The most the batch's KV caches can hold for ``sequences`` (the draft's too)."""
        assert self.engine is not None
        return projected(self.engine.models, sequences)

    def _reserve(self) -> None:
        """Reserve what the batch's KV caches can grow to (kept prefixes keep out of it)."""
        assert self.engine is not None
        self._projected = self._peak(self.engine.lengths())
        self.peak_projected_bytes = max(self.peak_projected_bytes, self._projected)
        self.rt.cache.reserve(self._projected + self._beside_bytes())

    def _engine(self) -> Engine:
        if self.engine is None:
            model, adapter, draft, k, adaptive = self.key
            named = draft if draft != LOOKUP else None  # a draft model to load
            self.generator = ChatGenerator.get_or_create(model, named, adapter, cache=self.rt.cache)
            budget = self.cfg.prefill_budget_s if self._budgeted else None
            if draft is not None:
                target, draft_model = self.generator.target, self.generator.draft
                planner = None
                if adaptive:
                    planner = Goodput(k, self.rt.policy.acceptance(model, draft))
                self.engine = SpecBatchEngine(
                    target, draft_model, k, planner, prefill_budget_s=budget
                )
            else:
                self.engine = BatchEngine(self.generator.target, self.cap, prefill_budget_s=budget)
            if (group := self.rt.cache.group) is not None:  # mirrored on every rank
                self.engine = GroupEngine(group, self.engine, self.generator.target)
        return self.engine

    def _publish(self) -> None:
        """Show the batch's state to the worker's registry entry (at most every
        :data:`PUBLISH_EVERY_S`; the heartbeat publishes it every 2 s)."""
        now = time.monotonic()
        if now < self._published_at + PUBLISH_EVERY_S:
            return
        self._published_at = now
        self.host.batch = BatchInfo(
            model=self.key[0],
            size=len(self.slots),
            limit=self._limit()[0],
            reason=self._reason,
            kv_mb=round(self._kv_bytes / 1e6, 1),
            kv_projected_mb=round(self._projected / 1e6, 1),
            kv_room_mb=round(self._room() / 1e6, 1),
        )

    # -- ending jobs ------------------------------------------------------
    def _end(self, ended: list[tuple[Job, ResultRecord]]) -> None:
        if ended:
            self.host.finish(ended)

    def _finish_outputs(self, done: list[Finished]) -> None:
        ended = []
        assert self.generator is not None
        for job_id, out in done:
            slot = self.slots.pop(str(job_id), None)
            if slot is None:  # (never expected: one sequence per job, see _again)
                log.error("batch output for job %s, which it does not hold; dropped", job_id)
                continue
            if isinstance(out, MlxqError):
                ended.append((slot.job, records.failure(slot.job, self.rt, out)))
                continue
            record = records.success(
                slot.job,
                self.rt,
                out,
                self.generator,
                batched_with=slot.peak,
                route=slot.route,
            )
            ended.append((slot.job, record))
        if ended:
            self._reserve()
        self._end(ended)

    def _expire(self) -> None:
        """Jobs that must stop (a cancel, a time limit: ``worker.runner.stops``) leave the
        batch now, each with one record of what it made."""
        due = self.stops.due(s.job for s in self.slots.values())
        if not due:
            return
        assert self.engine is not None
        ended = []
        for job, error in due:
            slot = self.slots.pop(job.id)
            cut = self.engine.remove(job.id)
            record = records.stopped(
                job, self.rt, error, [cut] if cut else [], batched_with=slot.peak
            )
            log.info("job %s stopped in the batch on %s: %s", job.id, self.key.model, error.code)
            ended.append((job, record))
        self._reserve()
        self._end(ended)
