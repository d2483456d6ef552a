"""Running one job alone: plain or speculative decoding, streamed or not.

A job gets here from the worker loop (``worker.loop``) already taken and
started by the lifecycle; what comes back is its result record, which the loop
ends it with. Jobs run by a continuous batch go through ``worker.continuous``.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from redis import Redis

from schemas import GenerationError, MlxqError, ResultRecord
from worker import records
from worker.constrain import token_bytes
from worker.engine import Deadline
from worker.generator import ChatGenerator
from worker.lifecycle import Job
from worker.policy import Decision
from worker.runtime import WorkerRuntime
from worker.streaming import ChunkWriter

log = logging.getLogger(__name__)


def run_chat_job(payload: dict[str, Any]) -> None:
    """The function every mlxq job hash names (``schemas.keys.JOB_FUNCTION``).

    mlxq jobs run in mlxq's own ``worker``, which reads job hashes itself and
    never calls this: an RQ worker that does fails the job with this message.
    """
    raise RuntimeError("mlxq jobs run only in mlxq's `worker`, not in an RQ worker")


def deadline_of(job: Job) -> Deadline | None:
    """The job's deadline, counted from when it was taken."""
    if not job.timeout_s:
        return None
    return Deadline(job.started.perf + job.timeout_s, job.timeout_s)


def run_alone(job: Job, rt: WorkerRuntime, conn: Redis) -> ResultRecord:
    """Generate ``job`` on its own. Whatever goes wrong becomes its failed record; only
    BaseExceptions (a cold shutdown) escape.

    With ``stream: true`` the text is also appended to the job's chunk stream
    (``worker.streaming``) as it is produced, ending with a final chunk.
    """
    req = job.envelope.request
    completion_id = records.new_completion_id()
    ttl = job.envelope.result_ttl
    writer = None
    try:
        rt.check_request(req)
        generator = ChatGenerator.get_or_create(req.model, req.draft_model, req.adapter, rt.cache)
        if req.stream:
            target = generator.target
            bytes_of = token_bytes(target.tokenizer, target.vocab_size) if req.logprobs else None
            writer = ChunkWriter(conn, job.id, completion_id, req.model, ttl, bytes_of)
            writer.start()
        decision = None
        if req.n > 1:
            if req.draft_model:
                decision = Decision(0, f"n={req.n}: the choices decode as one batch, plainly")
            out = generator.generate_choices(req, deadline=deadline_of(job))
            return records.success(
                job,
                rt,
                out,
                generator,
                completion_id=completion_id,
                batched_with=req.n,
                decision=decision,
            )
        if req.draft_model:
            decision = rt.policy.choose(req.model, req.draft_model, req.num_draft_tokens)
            if req.stream:  # say why a streamed job never shares a speculative batch
                reason = f"{decision.reason}; streamed, so alone (streams are not batched)"
                decision = dataclasses.replace(decision, reason=reason)
        out = generator.generate(
            req,
            rt.default_num_draft_tokens,
            writer.text if writer else None,
            num_draft_tokens=decision.k if decision and decision.speculative else None,
            use_draft=decision is not None and decision.speculative,
            deadline=deadline_of(job),
        )
        if decision is not None and req.draft_model:
            rt.policy.record(req.model, req.draft_model, decision, out)
        record = records.success(
            job, rt, out, generator, completion_id=completion_id, decision=decision
        )
        if writer and record.response:
            writer.finish(out.finish_reason, record.response.usage.model_dump())
        return record
    except MlxqError as e:
        record = records.failure(job, rt, e)
    except Exception as e:  # never let one job's surprise take the worker down
        log.exception("job %s failed unexpectedly", job.id)
        record = records.failure(job, rt, GenerationError(f"{type(e).__name__}: {e}"))
    if req.stream and record.error is not None:
        # Whatever failed, a streaming job's readers get a final (error) chunk.
        ChunkWriter(conn, job.id, completion_id, req.model, ttl).error(
            record.error.model_dump(mode="json")
        )
    return record
