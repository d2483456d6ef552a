"""Continuous batching: queued jobs on the same model (no draft) decode together.

When the worker dequeues a batchable job (not streaming, greedy or unseeded: a
seeded sampling job runs alone so its seed means what it says; and no draft
model, unless the speculation policy measured batching the waiting jobs to be
faster than speculating one at a time, see ``worker.policy``), it keeps taking
further compatible jobs from the same queue, up to ``max_batch``, also while
the batch runs (a slot freed by a finished job is filled at the next step).
All of them decode together through mlx-lm's ``BatchGenerator``, each with its
own sampler, logits processors, stop strings and max_tokens, and each gets its
own result record and metrics.

Every job taken is registered as started (with a lease the heartbeat thread
renews) before it joins the batch, so a worker that dies mid-batch loses
nothing: recovery requeues each job (see ``worker.recovery``).
"""

from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import mlx.core as mx
from mlx_lm.generate import BatchGenerator
from mlx_lm.sample_utils import make_sampler
from pydantic import ValidationError
from rq.executions import Execution
from rq.job import Job
from rq.queue import Queue
from rq.utils import now as rq_now

from schemas import GenerationError, JobEnvelope, JobTimeoutError, MlxqError, ResultRecord, keys
from schemas.store import queue_write_result
from worker import recovery, runtime
from worker.dequeue import hand_back, job_from, take
from worker.engine import GenerationOutput, _find_stop, _processors, params_for, prompt_tokens
from worker.generator import ChatGenerator
from worker.policy import Decision

if TYPE_CHECKING:
    from worker.rqworker import MlxqWorker

log = logging.getLogger(__name__)

BatchKey = tuple[str, str | None]


def batch_key(
    envelope: JobEnvelope, rt: runtime.WorkerRuntime, depth: int
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


@functools.lru_cache(maxsize=64)
def _sampler(temperature: float, top_p: float, min_p: float, top_k: int) -> Any:
    # Jobs with the same settings share one sampler object, so BatchGenerator
    # samples the whole batch in one call instead of one call per sequence.
    return make_sampler(temperature, top_p, min_p, top_k=top_k)


def envelope_of(job: Job) -> JobEnvelope | None:
    try:
        return JobEnvelope.model_validate(job.args[0])
    except (ValidationError, IndexError, TypeError, ValueError, KeyError):
        return None


@dataclass
class Slot:
    """One job in the running batch."""

    job: Job
    execution: Execution
    envelope: JobEnvelope
    started: Any  # worker.jobs.Start
    prompt: list[int]
    max_tokens: int
    stop: tuple[str, ...]
    detokenizer: Any
    decision: Decision | None = None  # a draft job's: batched instead of speculating
    admitted_at: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    text: str = ""
    tokens: list[int] = field(default_factory=list)

    def output(self, finish: str, end: float) -> GenerationOutput:
        first = self.first_token_at or end
        n = len(self.tokens)
        return GenerationOutput(
            text=self.text,
            finish_reason=finish,
            prompt_tokens=len(self.prompt),
            completion_tokens=n,
            time_to_first_token_s=first - self.admitted_at,
            prompt_tokens_per_s=len(self.prompt) / max(first - self.admitted_at, 1e-9),
            generation_tokens_per_s=n / max(end - first, 1e-9) if n > 1 else 0.0,
            total_time_s=end - self.admitted_at,
            draft_tokens_proposed=0,
            draft_tokens_accepted=0,
            peak_memory_gb=0.0,
            token_ids=tuple(self.tokens),
        )


class BatchRunner:
    """Runs one continuous batch for (model, adapter) on behalf of a worker."""

    def __init__(self, worker: MlxqWorker, queue: Queue, key: BatchKey, depth: int = 1) -> None:
        self.worker, self.queue, self.key, self.depth = worker, queue, key, depth
        self.rt = runtime.current()
        self.conn = worker.connection
        self.slots: dict[int, Slot] = {}
        self.generator: ChatGenerator | None = None
        self.gen: BatchGenerator | None = None
        self._pause_claims_until = 0.0
        self._speeds: dict[int, list[Any]] = {}  # batch size -> [tokens, seconds, steps]

    # -- taking jobs ------------------------------------------------------
    def _register(self, job: Job) -> tuple[Execution, bool]:
        """Start ``job`` (one MULTI/EXEC); also whether its result record already exists."""
        with self.conn.pipeline() as pipe:
            execution = Execution.create(
                job, self.worker.lease_s, pipeline=pipe, worker_name=self.worker.name
            )
            job.prepare_for_execution(self.worker.name, pipeline=pipe)
            pipe.lrem(keys.rq_intermediate_key(self.queue.name), 1, job.id)
            pipe.exists(keys.result_key(job.id))
            *_, existed = pipe.execute()
        return execution, bool(existed)

    def _claim(self) -> tuple[Job, Decision | None] | None:
        """Take the next job of our queue (and its hash); hand it back if it cannot join."""
        found = take(self.conn, self.queue)
        if found is None:
            return None
        job_id, data = found
        if any(slot.job.id == job_id for slot in self.slots.values()):
            # A second copy of a job running in this batch: that run finishes it.
            self.conn.lrem(keys.rq_intermediate_key(self.queue.name), 1, job_id)
            return None
        try:
            job = job_from(self.worker.job_class, job_id, data, self.conn)
        except Exception:
            self._hand_back(job_id)
            return None
        envelope = envelope_of(job)
        depth = max(self.depth, len(self.slots) + 1)
        taken = None if envelope is None else batch_key(envelope, self.rt, depth)
        if taken is None or taken[0] != self.key or job.func_name != keys.JOB_FUNCTION:
            self._hand_back(job_id)
            return None
        return job, taken[1]

    def _hand_back(self, job_id: str) -> None:
        hand_back(self.conn, self.queue, job_id)
        self._pause_claims_until = time.monotonic() + 1.0

    def _admit(self, job: Job, decision: Decision | None = None) -> None:
        """Register ``job`` as started and put it into the batch (or finish it at once)."""
        from worker.jobs import Start

        started = Start()
        execution, existed = self._register(job)
        envelope = envelope_of(job)
        assert envelope is not None
        if existed:
            self._bookkeep(job, execution)
            return
        try:
            target = self._target(envelope)
            req = envelope.request
            if req.draft_model:  # batched without it, but still only if allowed
                self.rt.check_allowed(req.draft_model, "draft model")
            prompt = prompt_tokens(target.tokenizer, req)
            params = params_for(
                req,
                len(prompt),
                target.context_length,
                int(target.config.get("vocab_size") or len(target.vocab())),
            )
        except MlxqError as e:
            self._finish_error(job, execution, envelope, started, e)
            return
        except Exception as e:  # never let one job's surprise take the worker down
            log.exception("job %s could not join the batch", job.id)
            self._finish_error(
                job, execution, envelope, started, GenerationError(f"{type(e).__name__}: {e}")
            )
            return
        assert self.gen is not None
        sampler = _sampler(params.temperature, params.top_p, params.min_p, params.top_k)
        (uid,) = self.gen.insert(
            [prompt],
            [params.max_tokens],
            samplers=[sampler],
            logits_processors=[_processors(params)],
        )
        self.slots[uid] = Slot(
            job,
            execution,
            envelope,
            started,
            prompt,
            params.max_tokens,
            params.stop,
            target.tokenizer.detokenizer,
            decision,
        )

    def _target(self, envelope: JobEnvelope) -> Any:
        if self.generator is None:
            req = envelope.request
            self.rt.check_allowed(req.model)
            if req.adapter:
                self.rt.check_allowed(req.adapter, "adapter")
            self.generator = ChatGenerator.get_or_create(
                req.model, None, req.adapter, self.rt.cache
            )
            tok = self.generator.target.tokenizer
            self.gen = BatchGenerator(
                self.generator.target.model,
                stop_tokens=[[t] for t in tok.eos_token_ids],
                completion_batch_size=self.worker.max_batch,
                prefill_batch_size=self.worker.max_batch,
            )
        return self.generator.target

    # -- finishing jobs ---------------------------------------------------
    def _bookkeep(
        self, job: Job, execution: Execution, record: ResultRecord | None = None, ttl: int = 0
    ) -> None:
        """RQ's success bookkeeping for one job of the batch, with its result record if
        given (one MULTI/EXEC, as on the one-at-a-time path)."""
        job.ended_at = rq_now()
        with self.conn.pipeline() as pipe:
            if record is not None:
                queue_write_result(pipe, record, ttl)
            self.worker.finish_success(job, execution, pipe)
            execution.delete(job=job, pipeline=pipe)
            pipe.execute()

    def _finish(self, uid: int, finish: str) -> None:
        from worker.jobs import record_success

        slot = self.slots.pop(uid)
        if slot.detokenizer is not None:
            slot.detokenizer.finalize()
            slot.text += slot.detokenizer.last_segment
        out = slot.output(finish, time.perf_counter())
        out = replace(out, peak_memory_gb=mx.get_peak_memory() / 1e9)
        assert self.generator is not None
        record = record_success(
            slot.envelope,
            self.rt,
            slot.started,
            out,
            self.generator,
            batched_with=len(self.slots) + 1,
            decision=slot.decision,
        )
        self._bookkeep(slot.job, slot.execution, record, slot.envelope.result_ttl)

    def _finish_error(
        self, job: Job, execution: Execution, envelope: JobEnvelope, started: Any, e: MlxqError
    ) -> None:
        from worker.jobs import record_failure

        record = record_failure(e, self.rt, envelope, started)
        self._bookkeep(job, execution, record, envelope.result_ttl)

    # -- the loop ---------------------------------------------------------
    def _renew_leases(self) -> None:
        with self.conn.pipeline() as pipe:
            for slot in list(self.slots.values()):
                slot.execution.heartbeat(slot.job.started_job_registry, self.worker.lease_s, pipe)
            pipe.execute()

    def _fill(self) -> None:
        while (
            len(self.slots) < self.worker.max_batch
            and not self.worker._stop_requested
            and time.monotonic() >= self._pause_claims_until
            and (taken := self._claim()) is not None
        ):
            self._admit(*taken)

    def _step(self) -> int:
        """One decoding step of the batch; the number of tokens it produced."""
        assert self.gen is not None
        _, responses = self.gen.next()
        now = time.perf_counter()
        for r in responses:
            slot = self.slots.get(r.uid)
            if slot is None:
                continue
            if slot.first_token_at is None:
                slot.first_token_at = now
            slot.tokens.append(int(r.token))
            if r.finish_reason == "stop":  # EOS: not part of the text
                self._finish(r.uid, "stop")
                continue
            before = len(slot.text)
            slot.detokenizer.add_token(int(r.token))
            if r.finish_reason == "length":
                slot.detokenizer.finalize()
            slot.text += slot.detokenizer.last_segment
            longest = max((len(s) for s in slot.stop), default=0)
            at = _find_stop(slot.text, slot.stop, max(0, before - longest + 1)) if slot.stop else -1
            if at >= 0:
                slot.text = slot.text[:at]
                slot.detokenizer = None
                if r.finish_reason is None:  # else the generator has dropped it already
                    self.gen.remove([r.uid])
                self._finish(r.uid, "stop")
            elif r.finish_reason == "length":
                slot.detokenizer = None
                self._finish(r.uid, "length")
        return len(responses)

    def _expire(self) -> None:
        now = time.perf_counter()
        for uid, slot in list(self.slots.items()):
            timeout = slot.job.timeout or self.queue.DEFAULT_TIMEOUT
            if timeout > 0 and now - slot.started.perf >= timeout:
                assert self.gen is not None
                self.gen.remove([uid])
                del self.slots[uid]
                self._finish_error(
                    slot.job,
                    slot.execution,
                    slot.envelope,
                    slot.started,
                    JobTimeoutError(f"job timed out after {timeout}s (in a batch)"),
                )

    def _measure(self, size: int, tokens: int, seconds: float) -> None:
        """Pool (tokens, seconds) per batch size; report to the policy every 32 steps."""
        pooled = self._speeds.setdefault(size, [0, 0.0, 0])
        pooled[0] += tokens
        pooled[1] += seconds
        pooled[2] += 1
        if pooled[2] >= 32:
            self._report(size)

    def _report(self, size: int) -> None:
        tokens, seconds, _ = self._speeds.pop(size)
        self.rt.policy.record_batch(self.key[0], self.key[1], size, int(tokens), seconds)

    def run(self, first: Job, decision: Decision | None = None) -> None:
        from worker.rqworker import ColdShutdown

        try:
            self._admit(first, decision)
            self._fill()  # take the queued companions before the first step
            last_beat = time.monotonic()
            while self.slots:
                size, t = len(self.slots), time.perf_counter()
                produced = self._step()
                self._expire()
                self._fill()
                self._measure(size, produced, time.perf_counter() - t)
                if time.monotonic() - last_beat >= self.worker.lease_s / 3:
                    last_beat = time.monotonic()
                    self._renew_leases()
                    self.worker.heartbeat()
            for size in list(self._speeds):
                self._report(size)
        except ColdShutdown:
            for slot in self.slots.values():
                with self.conn.pipeline() as pipe:
                    slot.execution.delete(job=slot.job, pipeline=pipe)
                    pipe.execute()
                recovery.requeue(self.conn, self.queue.name, slot.job.id)
            log.warning("cold shutdown: %d batched job(s) requeued", len(self.slots))
            self.slots.clear()
            raise SystemExit(0) from None
        except Exception as e:
            log.exception("batch on %s failed; failing its %d job(s)", self.key[0], len(self.slots))
            for slot in list(self.slots.values()):
                self._finish_error(
                    slot.job,
                    slot.execution,
                    slot.envelope,
                    slot.started,
                    GenerationError(f"{type(e).__name__}: {e}"),
                )
            self.slots.clear()
        finally:
            if self.gen is not None:
                self.gen.close()
