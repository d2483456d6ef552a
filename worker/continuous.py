"""Continuous batching of jobs: while a batch runs, the worker keeps taking jobs into it.

When the worker takes a job that may share a batch (:func:`batch_key`: not
streaming, greedy or unseeded, since a seeded sampling job runs alone so that
its seed means what it says; and no draft model, unless the speculation policy
measured batching the waiting jobs to be faster than speculating one at a
time), it runs a :class:`ContinuousBatch`: further jobs of the same queue on
the same (model, adapter) join, up to ``max_batch``, also while the batch runs
(a slot freed by a finished job is filled at the next step). A job that cannot
join is given back to the front of its queue and the batch stops taking for a
second, so first-in-first-out order holds.

Jobs are taken, refused, ended and given back through the same lifecycle as
jobs run alone (``worker.lifecycle``); tokens come from the batched engine
(``worker.batching``).
"""

from __future__ import annotations

import logging
import time
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol

from schemas import GenerationError, JobEnvelope, MlxqError, ResultRecord
from worker import records
from worker.batching import BatchEngine
from worker.engine import GenerationOutput, params_for, prompt_tokens
from worker.generator import ChatGenerator
from worker.jobs import deadline_of
from worker.lifecycle import Job, Lifecycle
from worker.policy import Decision
from worker.runtime import WorkerRuntime

log = logging.getLogger(__name__)

BatchKey = tuple[str, str | None]

#: Seconds a batch stops taking jobs after one could not join (FIFO: it waits first).
PAUSE_AFTER_HAND_BACK_S = 1.0
#: Steps pooled per batch size before the measured speed goes to the policy.
MEASURE_STEPS = 32


def batch_key(
    envelope: JobEnvelope, rt: WorkerRuntime, depth: int
) -> tuple[BatchKey, Decision | None] | None:
    """The (model, adapter) batch a job may join, or None if it runs alone.

    A job naming a draft joins only when the speculation policy finds batching
    ``depth`` jobs faster than speculating one at a time; the policy's decision
    (plain decoding, and why) comes along for its metrics.
    """
    req = envelope.request
    if req.stream or (req.seed is not None and req.temperature > 0):
        return None
    key = (req.model, req.adapter)
    if not req.draft_model:
        return key, None
    decision = rt.policy.batch_instead(
        req.model, req.draft_model, req.adapter, depth, req.num_draft_tokens
    )
    return (key, decision) if decision is not None else None


class Host(Protocol):
    """What a batch needs from the worker that runs it (``worker.loop.Worker``)."""

    rt: WorkerRuntime
    lifecycle: Lifecycle
    max_batch: int

    def take_from(self, queue: str) -> Job | None: ...

    def finish(self, ended: list[tuple[Job, ResultRecord]]) -> None: ...

    def computing(self) -> AbstractContextManager[None]: ...


@dataclass
class _Slot:
    job: Job
    decision: Decision | None


class ContinuousBatch:
    """One continuous batch for (model, adapter), run on behalf of a worker."""

    def __init__(self, host: Host, queue: str, key: BatchKey, depth: int = 1) -> None:
        self.host, self.queue, self.key, self.depth = host, queue, key, depth
        self.rt = host.rt
        self.slots: dict[str, _Slot] = {}
        self.generator: ChatGenerator | None = None
        self.engine: BatchEngine | None = None
        self._pause_until = 0.0
        self._speeds: dict[int, list[float]] = {}  # batch size -> [tokens, seconds, steps]

    def run(self, first: Job, decision: Decision | None = None) -> None:
        """Decode ``first`` and every job that joins until the batch is empty.

        A BaseException (a cold shutdown) gives every job still in the batch back
        to its queue; an unexpected error fails them.
        """
        try:
            self._admit(first, decision)
            self._fill()  # the queued companions join before the first step
            while self.slots:
                assert self.engine is not None
                size, t = len(self.slots), time.perf_counter()
                with self.host.computing():
                    produced, done = self.engine.step()
                self._finish_outputs(done)
                self._expire()
                self._fill()
                self._measure(size, produced, time.perf_counter() - t)
            for size in list(self._speeds):
                self._report(size)
        except Exception as e:
            log.exception("batch on %s failed; failing its %d job(s)", self.key[0], len(self.slots))
            error = GenerationError(f"{type(e).__name__}: {e}")
            self._end([(s.job, records.failure(s.job, self.rt, error)) for s in self._drain()])
        except BaseException:
            for slot in self._drain():
                self.host.lifecycle.requeue(slot.job)
            raise
        finally:
            if self.engine is not None:
                self.engine.close()

    def _drain(self) -> list[_Slot]:
        """Every job still in the batch (the batch is empty afterwards)."""
        slots, self.slots = list(self.slots.values()), {}
        return slots

    # -- taking jobs ------------------------------------------------------
    def _fill(self) -> None:
        while len(self.slots) < self.host.max_batch and time.monotonic() >= self._pause_until:
            job = self.host.take_from(self.queue)
            if job is None:
                return
            depth = max(self.depth, len(self.slots) + 1)
            taken = batch_key(job.envelope, self.rt, depth)
            if taken is None or taken[0] != self.key:
                self.host.lifecycle.requeue(job)
                self._pause_until = time.monotonic() + PAUSE_AFTER_HAND_BACK_S
                return
            self._admit(job, taken[1])

    def _admit(self, job: Job, decision: Decision | None) -> None:
        """Put ``job`` into the batch, or end it at once with what stops it."""
        req = job.envelope.request
        try:
            self.rt.check_request(req)  # the draft too: batched without it, but named
            with self.host.computing():
                engine = self._engine(job)
            target = engine.target
            prompt = prompt_tokens(target.tokenizer, req)
            params = params_for(req, len(prompt), target.context_length, target.vocab_size)
            assert self.generator is not None
            with self.host.computing():  # a shared prefix not kept yet is prefilled once here
                start = self.generator.starting_cache(req, prompt, len(prompt) - 1)
        except MlxqError as e:
            self._end([(job, records.failure(job, self.rt, e))])
            return
        except Exception as e:  # never let one job's surprise take the batch down
            log.exception("job %s could not join the batch", job.id)
            error = GenerationError(f"{type(e).__name__}: {e}")
            self._end([(job, records.failure(job, self.rt, error))])
            return
        engine.add(job.id, prompt, params, *start)
        self.slots[job.id] = _Slot(job, decision)

    def _engine(self, job: Job) -> BatchEngine:
        if self.engine is None:
            req = job.envelope.request
            self.generator = ChatGenerator.get_or_create(
                req.model, None, req.adapter, self.rt.cache
            )
            self.engine = BatchEngine(self.generator.target, self.host.max_batch)
        return self.engine

    # -- ending jobs ------------------------------------------------------
    def _end(self, ended: list[tuple[Job, ResultRecord]]) -> None:
        if ended:
            self.host.finish(ended)

    def _finish_outputs(self, done: list[tuple[Any, GenerationOutput]]) -> None:
        ended = []
        assert self.generator is not None
        for job_id, out in done:
            slot = self.slots.pop(job_id)
            record = records.success(
                slot.job,
                self.rt,
                out,
                self.generator,
                batched_with=len(self.slots) + 1,
                decision=slot.decision,
            )
            ended.append((slot.job, record))
        self._end(ended)

    def _expire(self) -> None:
        ended = []
        for job_id, slot in list(self.slots.items()):
            deadline = deadline_of(slot.job)
            if deadline is not None and deadline.passed:
                assert self.engine is not None
                self.engine.drop(job_id)
                del self.slots[job_id]
                ended.append((slot.job, records.failure(slot.job, self.rt, deadline.error())))
        self._end(ended)

    # -- measuring --------------------------------------------------------
    def _measure(self, size: int, tokens: int, seconds: float) -> None:
        """Pool (tokens, seconds) per batch size; report to the policy every few steps."""
        pooled = self._speeds.setdefault(size, [0, 0.0, 0])
        pooled[0] += tokens
        pooled[1] += seconds
        pooled[2] += 1
        if pooled[2] >= MEASURE_STEPS:
            self._report(size)

    def _report(self, size: int) -> None:
        tokens, seconds, _ = self._speeds.pop(size)
        self.rt.policy.record_batch(self.key[0], self.key[1], size, int(tokens), seconds)
