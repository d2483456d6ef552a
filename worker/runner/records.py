"""Result records: the chat.completion and metrics of a finished job, or its error."""

from __future__ import annotations

import functools
import time
import uuid
from importlib.metadata import PackageNotFoundError, version

from schemas import (
    AssistantMessage,
    ChatCompletion,
    Choice,
    Metrics,
    MlxqError,
    ResultRecord,
    Usage,
)
from schemas.result import CompletionTokensDetails, Partial, PromptTokensDetails
from worker.engine import GenerationOutput, reasoning, toolcalls
from worker.engine.constrain import token_bytes
from worker.engine.generator import ChatGenerator
from worker.engine.logprobs import render
from worker.engine.parser import OutputParser
from worker.lifecycle.held import Job
from worker.runner.runtime import WorkerRuntime
from worker.schedule.route import Route


@functools.cache
def package_version(dist: str) -> str | None:
    try:
        return version(dist)
    except PackageNotFoundError:
        return None


def new_completion_id() -> str:
    return f"chatcmpl-{uuid.uuid4().hex[:24]}"


def completion_for(
    job: Job,
    out: GenerationOutput,
    completion_id: str,
    generator: ChatGenerator,
    parser: OutputParser | None = None,
) -> ChatCompletion:
    """The OpenAI ``chat.completion`` object for a finished generation (its n choices).
    ``parser``: the one a streamed job's text went through, whose final state is then
    the message (its stream and its record agree by construction)."""
    bytes_of = None
    if out.logprobs is not None:
        bytes_of = token_bytes(generator.target.tokenizer, generator.target.vocab_size)
    request = job.envelope.request
    tokenizer = generator.target.tokenizer
    family = toolcalls.family_of(tokenizer) if request.uses_tools else None
    tools = request.template_tools
    thinking = None if request.raw_prompt else reasoning.thinking_of(tokenizer)
    thought = 0  # reasoning tokens, over the choices

    def message(o: GenerationOutput, choice: int) -> tuple[AssistantMessage, str]:
        nonlocal thought
        if choice == 0 and parser is not None:
            final = parser
        else:
            final = OutputParser(thinking, o.in_reasoning, family)
            final.feed(o.text)
        msg, reason = final.message(
            o.finish_reason, tools, lambda n: toolcalls.call_id(completion_id, choice, n)
        )
        if thinking is not None:
            opened = o.in_reasoning or msg.reasoning_content is not None
            thought += reasoning.reasoning_tokens(o.token_ids, thinking, opened)
        return msg, reason

    choices = []
    for i, o in enumerate((out, *out.others)):
        msg, reason = message(o, i)
        choices.append(
            Choice(
                index=i,
                message=msg,
                finish_reason=reason,
                stop_reason=o.stop_sequence if reason == "stop" else None,
                logprobs=render(o.logprobs, bytes_of)
                if o.logprobs is not None and bytes_of
                else None,
            )
        )
    return ChatCompletion(
        id=completion_id,
        created=int(time.time()),
        model=request.model,
        choices=choices,
        usage=Usage(
            prompt_tokens=out.prompt_tokens,
            completion_tokens=out.completion_tokens,
            total_tokens=out.prompt_tokens + out.completion_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=out.cached_tokens),
            completion_tokens_details=CompletionTokensDetails(reasoning_tokens=thought)
            if thinking is not None
            else None,
        ),
        system_fingerprint=(f"mlxq-mlx{package_version('mlx')}-mlxlm{package_version('mlx-lm')}"),
    )


def base_metrics(rt: WorkerRuntime, job: Job) -> Metrics:
    """What every record of ``job`` carries, succeeded or not."""
    return Metrics(
        worker_id=rt.worker_id,
        queue_wait_s=max(0.0, job.started.wall - job.envelope.submitted_at),
        draft_model=getattr(job.envelope.request, "draft_model", None),  # chat jobs only
        mlx_version=package_version("mlx"),
        mlx_lm_version=package_version("mlx-lm"),
        total_time_s=job.started.elapsed(),
    )


def success(
    job: Job,
    rt: WorkerRuntime,
    out: GenerationOutput,
    generator: ChatGenerator,
    *,
    completion_id: str | None = None,
    batched_with: int = 1,
    route: Route | None = None,
    parser: OutputParser | None = None,
) -> ResultRecord:
    """The succeeded record (completion and metrics) for a finished generation, run as
    ``route`` says (None: plainly, no proposer). ``parser``: a streamed job's (see
    :func:`completion_for`)."""
    req = job.envelope.request
    rt.stats.add(req.model, req.draft_model, out)
    decision = route.decision if route is not None else None
    speculative = route is not None and route.speculative
    metrics = base_metrics(rt, job).model_copy(
        update={
            "load_time_s": generator.load_time_s,
            "cache_hit": generator.cache_hit,
            "time_to_first_token_s": out.time_to_first_token_s,
            "prompt_tokens_per_s": out.prompt_tokens_per_s,
            "generation_tokens_per_s": out.generation_tokens_per_s,
            "num_draft_tokens": decision.k if decision and speculative else None,
            "speculative": speculative,
            "speculation_method": _method(route, generator),
            "speculation_reason": decision.reason if decision else None,
            "draft_tokens_proposed": out.draft_tokens_proposed,
            "draft_tokens_accepted": out.draft_tokens_accepted,
            "acceptance_rate": out.acceptance_rate,
            "peak_memory_gb": out.peak_memory_gb,
            "batch_size": batched_with,
            "cached_tokens": out.cached_tokens,
            "kv_bits": generator.target.kv_bits,
        }
    )
    return ResultRecord(
        job_id=job.id,
        batch_id=job.envelope.batch_id,
        custom_id=job.envelope.custom_id,
        status="succeeded",
        response=completion_for(job, out, completion_id or new_completion_id(), generator, parser),
        metrics=metrics,
        finished_at=time.time(),
    )


def _method(route: Route | None, generator: ChatGenerator) -> str | None:
    """How its tokens were proposed: "draft", "eagle3", "mtp" or "dflash" (a drafter named as the
    draft), or "prompt_lookup"; None when it did not speculate."""
    method = route.method if route is not None else None
    return generator.drafter.method if method == "draft" and generator.drafter else method


def failure(job: Job, rt: WorkerRuntime, error: MlxqError) -> ResultRecord:
    """The failed record of a job that was taken and could not finish."""
    env = job.envelope
    return ResultRecord.failed(
        job.id, env.batch_id, env.custom_id, error, metrics=base_metrics(rt, job)
    )


def stopped(
    job: Job,
    rt: WorkerRuntime,
    error: MlxqError,
    outs: list[GenerationOutput],
    *,
    batched_with: int = 1,
) -> ResultRecord:
    """The record of a job stopped while it ran (``error``: cancelled, or its time limit):
    failed (or ``cancelled``) as ``error`` says, with what each choice made so far and
    the tokens used (``outs``: cut, ``worker.engine.sequence.CUT``; none: it made
    nothing yet)."""
    env = job.envelope
    metrics = base_metrics(rt, job).model_copy(update={"batch_size": batched_with})
    partial = None
    if outs:
        first = outs[0]
        completion = sum(o.completion_tokens for o in outs)
        partial = Partial(
            texts=[o.text for o in outs],
            usage=Usage(
                prompt_tokens=first.prompt_tokens,
                completion_tokens=completion,
                total_tokens=first.prompt_tokens + completion,
                prompt_tokens_details=PromptTokensDetails(cached_tokens=first.cached_tokens),
            ),
        )
        ttft = first.time_to_first_token_s if first.completion_tokens else None
        metrics = metrics.model_copy(
            update={"time_to_first_token_s": ttft, "cached_tokens": first.cached_tokens}
        )
    return ResultRecord.failed(
        job.id, env.batch_id, env.custom_id, error, metrics=metrics, partial=partial
    )
