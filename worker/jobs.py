"""The job function: validate -> cache -> engine -> one result record in Redis.

``run_chat_job`` is the only function a worker executes (``schemas.keys.JOB_FUNCTION``).
"""

from __future__ import annotations

import functools
import logging
import time
import uuid
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from pydantic import ValidationError
from redis import Redis
from rq import get_current_job
from rq.timeouts import JobTimeoutException

from schemas import (
    AssistantMessage,
    ChatCompletion,
    Choice,
    ErrorInfo,
    InvalidRequestError,
    JobEnvelope,
    JobTimeoutError,
    Metrics,
    MlxqError,
    ResultRecord,
    Usage,
    describe_validation_error,
    keys,
)
from schemas.store import has_result, write_result
from worker import runtime
from worker.engine import GenerationOutput
from worker.generator import ChatGenerator
from worker.policy import Decision
from worker.streaming import ChunkWriter

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Start:
    """When a job started: wall clock (for queue wait) and perf counter (for durations)."""

    wall: float = field(default_factory=time.time)
    perf: float = field(default_factory=time.perf_counter)

    def elapsed(self) -> float:
        return time.perf_counter() - self.perf


@functools.cache
def _version(dist: str) -> str | None:
    try:
        return version(dist)
    except PackageNotFoundError:
        return None


def completion_for(
    envelope: JobEnvelope, out: GenerationOutput, completion_id: str | None = None
) -> ChatCompletion:
    """The OpenAI ``chat.completion`` object for a finished generation."""
    return ChatCompletion(
        id=completion_id or f"chatcmpl-{uuid.uuid4().hex[:24]}",
        created=int(time.time()),
        model=envelope.request.model,
        choices=[
            Choice(message=AssistantMessage(content=out.text), finish_reason=out.finish_reason)
        ],
        usage=Usage(
            prompt_tokens=out.prompt_tokens,
            completion_tokens=out.completion_tokens,
            total_tokens=out.prompt_tokens + out.completion_tokens,
        ),
        system_fingerprint=f"mlxq-mlx{_version('mlx')}-mlxlm{_version('mlx-lm')}",
    )


def _base_metrics(rt: runtime.WorkerRuntime, envelope: JobEnvelope | None, t0: Start) -> Metrics:
    wait = max(0.0, t0.wall - envelope.submitted_at) if envelope else None
    request = envelope.request if envelope else None
    return Metrics(
        worker_id=rt.worker_id,
        queue_wait_s=wait,
        draft_model=request.draft_model if request else None,
        mlx_version=_version("mlx"),
        mlx_lm_version=_version("mlx-lm"),
    )


def execute(
    envelope: JobEnvelope, rt: runtime.WorkerRuntime, t0: Start, conn: Redis
) -> ResultRecord:
    """Run one validated job; raise an :class:`MlxqError` for anything the job got wrong.

    With ``stream: true`` the text is also appended, as it is produced, to the
    job's chunk stream (``worker.streaming``).
    """
    req = envelope.request
    completion_id = f"chatcmpl-{uuid.uuid4().hex[:24]}"
    rt.check_allowed(req.model)
    if req.draft_model:
        rt.check_allowed(req.draft_model, "draft model")
    if req.adapter:
        rt.check_allowed(req.adapter, "adapter")
    generator = ChatGenerator.get_or_create(req.model, req.draft_model, req.adapter, rt.cache)
    writer = None
    if req.stream:
        writer = ChunkWriter(conn, envelope.job_id, completion_id, req.model, envelope.result_ttl)
        writer.start()
    decision = None
    if req.draft_model:
        decision = rt.policy.choose(req.model, req.draft_model, req.num_draft_tokens)
    out = generator.generate(
        req,
        rt.default_num_draft_tokens,
        writer.text if writer else None,
        num_draft_tokens=decision.k if decision and decision.speculative else None,
        use_draft=decision is not None and decision.speculative,
    )
    if decision is not None and req.draft_model:
        rt.policy.record(req.model, req.draft_model, decision, out)
    record = record_success(
        envelope, rt, t0, out, generator, completion_id=completion_id, decision=decision
    )
    if writer and record.response:
        writer.finish(out.finish_reason, record.response.usage.model_dump())
    return record


def record_success(
    envelope: JobEnvelope,
    rt: runtime.WorkerRuntime,
    t0: Start,
    out: GenerationOutput,
    generator: ChatGenerator,
    *,
    completion_id: str | None = None,
    batched_with: int = 1,
    decision: Decision | None = None,
) -> ResultRecord:
    """The succeeded result record (completion and metrics) for a finished generation."""
    req = envelope.request
    rt.stats.add(req.model, req.draft_model, out)
    metrics = _base_metrics(rt, envelope, t0).model_copy(
        update={
            "load_time_s": generator.load_time_s,
            "cache_hit": generator.cache_hit,
            "time_to_first_token_s": out.time_to_first_token_s,
            "prompt_tokens_per_s": out.prompt_tokens_per_s,
            "generation_tokens_per_s": out.generation_tokens_per_s,
            "num_draft_tokens": decision.k if decision and decision.speculative else None,
            "speculative": bool(decision and decision.speculative),
            "speculation_reason": decision.reason if decision else None,
            "draft_tokens_proposed": out.draft_tokens_proposed,
            "draft_tokens_accepted": out.draft_tokens_accepted,
            "acceptance_rate": out.acceptance_rate,
            "peak_memory_gb": out.peak_memory_gb,
            "total_time_s": t0.elapsed(),
            "batch_size": batched_with,
        }
    )
    return ResultRecord(
        job_id=envelope.job_id,
        batch_id=envelope.batch_id,
        custom_id=envelope.custom_id,
        status="succeeded",
        response=completion_for(envelope, out, completion_id),
        metrics=metrics,
        finished_at=time.time(),
    )


def record_failure(
    error: MlxqError, rt: runtime.WorkerRuntime, envelope: JobEnvelope, t0: Start
) -> ResultRecord:
    """The failed result record for a validated job."""
    ids = (envelope.job_id, envelope.batch_id, envelope.custom_id)
    return _failure(error, rt, ids, envelope, t0)


def _failure(
    error: MlxqError,
    rt: runtime.WorkerRuntime,
    ids: tuple[str, str, str],
    envelope: JobEnvelope | None,
    t0: Start,
) -> ResultRecord:
    job_id, batch_id, custom_id = ids
    metrics = _base_metrics(rt, envelope, t0).model_copy(update={"total_time_s": t0.elapsed()})
    return ResultRecord(
        job_id=job_id,
        batch_id=batch_id,
        custom_id=custom_id,
        status="failed",
        status_code=error.status_code,
        error=ErrorInfo(message=str(error), type=error.type, code=error.code),
        metrics=metrics,
        finished_at=time.time(),
    )


def _ids(payload: Any, job_id: str | None) -> tuple[str, str, str]:
    data = payload if isinstance(payload, dict) else {}
    jid = str(data.get("job_id") or job_id or "unknown")
    batch = str(data.get("batch_id") or keys.batch_of(jid))
    return jid, batch, str(data.get("custom_id") or "")


def run_chat_job(payload: dict[str, Any]) -> dict[str, Any]:
    """Run one chat job and write its result record (once) to Redis.

    Errors the job is responsible for (bad payload, unknown or disallowed
    model, incompatible draft, over-long prompt) become a failed record and the
    function returns normally; a timeout or an unexpected error is recorded
    and then re-raised so RQ marks the job failed too. When the worker asks
    (``defers_result`` on the job), a record of a job that returns normally is
    left on the job for the worker to write with its bookkeeping.
    """
    t0 = Start()
    rq_job = get_current_job()
    if rq_job is None:
        raise RuntimeError("run_chat_job runs inside an RQ worker (there is no current job)")
    rt = runtime.current()
    conn: Redis = rq_job.connection
    ids = _ids(payload, rq_job.id)
    existed = getattr(rq_job, "result_existed", None)  # read by the worker as the job started
    if existed is None:
        existed = has_result(conn, ids[0])
    if existed:
        log.info("job %s already has a result; not running it again", ids[0])
        return {"status": "duplicate"}
    envelope = None
    reraise: BaseException | None = None
    try:
        try:
            envelope = JobEnvelope.model_validate(payload)
        except ValidationError as e:
            raise InvalidRequestError(f"invalid job payload: {describe_validation_error(e)}") from e
        record = execute(envelope, rt, t0, conn)
    except MlxqError as e:
        record = _failure(e, rt, ids, envelope, t0)
    except JobTimeoutException as e:
        record = _failure(JobTimeoutError(f"job timed out: {e}"), rt, ids, envelope, t0)
        reraise = e
    except Exception as e:
        log.exception("job %s failed unexpectedly", ids[0])
        record = _failure(MlxqError(f"{type(e).__name__}: {e}"), rt, ids, envelope, t0)
        reraise = e
    ttl = envelope.result_ttl if envelope else keys.DEFAULT_RESULT_TTL
    if envelope is not None and envelope.request.stream and record.error is not None:
        # Whatever failed, a streaming job's readers get a final (error) chunk.
        ChunkWriter(conn, envelope.job_id, "", envelope.request.model, ttl).error(
            record.error.model_dump(mode="json")
        )
    if reraise is None and getattr(rq_job, "defers_result", False):
        # MlxqWorker writes it with the job's success bookkeeping (one round trip).
        rq_job.deferred_result = (record, ttl)
        log.info("job %s %s", ids[0], record.status)
        return {"status": record.status}
    written = write_result(conn, record, ttl)
    log.info("job %s %s%s", ids[0], record.status, "" if written else " (a result already existed)")
    if reraise is not None:
        raise reraise
    return {"status": record.status}
