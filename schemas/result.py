"""Result records (what workers write) and OpenAI Batch output lines (what producers emit)."""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from schemas.audio import Transcription
from schemas.embeddings import EmbeddingList
from schemas.errors import MlxqError
from schemas.tools import ToolCall

FinishReason = Literal["stop", "length", "tool_calls"]


class PromptTokensDetails(BaseModel):
    """OpenAI's ``usage.prompt_tokens_details``."""

    cached_tokens: int = 0


class CompletionTokensDetails(BaseModel):
    """OpenAI's ``usage.completion_tokens_details``: the reasoning tokens of a
    reasoning model (counted in ``completion_tokens`` too, and in ``max_tokens``)."""

    reasoning_tokens: int = 0


class Usage(BaseModel):
    """Token usage in OpenAI's shape."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None
    completion_tokens_details: CompletionTokensDetails | None = None


class AssistantMessage(BaseModel):
    """The answer: its text, and the tool calls it made (content null if only calls)."""

    role: Literal["assistant"] = "assistant"
    content: str | None
    reasoning_content: str | None = None  # a reasoning model's thinking, apart
    tool_calls: list[ToolCall] | None = None


class TopLogprob(BaseModel):
    """One candidate token: its text, log-probability and UTF-8 bytes (OpenAI's shape)."""

    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    """A completion token with the most likely tokens at its position."""

    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChoiceLogprobs(BaseModel):
    """OpenAI's ``choices[].logprobs``."""

    content: list[TokenLogprob] | None = None
    refusal: list[TokenLogprob] | None = None


class Choice(BaseModel):
    index: int = 0
    message: AssistantMessage
    finish_reason: FinishReason
    logprobs: ChoiceLogprobs | None = None
    #: mlxq, as vLLM: the stop string that ended the choice (None: EOS, length, a call).
    stop_reason: str | None = None


class ChatCompletion(BaseModel):
    """An OpenAI ``chat.completion`` object."""

    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[Choice]
    usage: Usage
    system_fingerprint: str | None = None


class ErrorInfo(BaseModel):
    """An OpenAI-style error object."""

    message: str
    type: str = "server_error"
    code: str = "server_error"
    param: str | None = None

    @classmethod
    def of(cls, error: MlxqError) -> ErrorInfo:
        return cls(message=str(error), type=error.type, code=error.code)


class Metrics(BaseModel):
    """What a worker measured while running one job. Times in seconds."""

    model_config = ConfigDict(extra="allow")

    worker_id: str
    queue_wait_s: float | None = None
    load_time_s: float = 0.0
    cache_hit: bool = False
    time_to_first_token_s: float | None = None
    prompt_tokens_per_s: float | None = None
    generation_tokens_per_s: float | None = None
    total_time_s: float | None = None
    draft_model: str | None = None
    speculative: bool = False
    speculation_reason: str | None = None
    speculation_method: str | None = None  # draft, eagle3, mtp, dflash, prompt_lookup
    num_draft_tokens: int | None = None
    draft_tokens_proposed: int = 0
    draft_tokens_accepted: int = 0
    acceptance_rate: float | None = None
    peak_memory_gb: float | None = None
    mlx_version: str | None = None
    mlx_lm_version: str | None = None
    batch_size: int = 1
    cached_tokens: int = 0  # prompt tokens taken from the prefix cache (usage says it too)
    kv_bits: int | None = None  # its full-attention KV cache's bits (worker --kv-bits); None: not


class Partial(BaseModel):
    """What a job stopped while it ran (cancelled, or past its time limit) had made: the
    text of each choice so far and the tokens it used. ``cut``: the text ends where the
    job was stopped, not where the model ended it (reasoning and tool calls unparsed)."""

    texts: list[str]
    usage: Usage
    cut: Literal[True] = True


#: What a succeeded job answers: a chat completion, an embeddings list or a transcription.
Response = Annotated[ChatCompletion | EmbeddingList | Transcription, Field(discriminator="object")]


class ResultRecord(BaseModel):
    """The JSON stored at ``mlxq:result:<job_id>``: exactly one per job."""

    job_id: str
    batch_id: str
    custom_id: str
    status: Literal["succeeded", "failed", "cancelled"]
    status_code: int = 200
    response: Response | None = None
    error: ErrorInfo | None = None
    metrics: Metrics | None = None
    finished_at: float
    partial: Partial | None = None  # a job stopped while it ran: what it made

    @property
    def usage(self) -> Any:
        """The tokens the job used (its response's ``usage``: a chat completion's or an
        embeddings list's), or what it used before it was stopped."""
        if self.partial is not None:
            return self.partial.usage
        return getattr(self.response, "usage", None)

    @classmethod
    def failed(
        cls,
        job_id: str,
        batch_id: str,
        custom_id: str,
        error: MlxqError,
        *,
        metrics: Metrics | None = None,
        finished_at: float | None = None,
        partial: Partial | None = None,
    ) -> ResultRecord:
        """The record of a job that ended without a completion (the one place that builds
        one: workers, recovery and ``producer cancel`` all use it); ``partial``: what it
        made before it was stopped."""
        return cls(
            job_id=job_id,
            batch_id=batch_id,
            custom_id=custom_id,
            status="cancelled" if error.code == "cancelled" else "failed",
            status_code=error.status_code,
            error=ErrorInfo.of(error),
            metrics=metrics,
            finished_at=time.time() if finished_at is None else finished_at,
            partial=partial,
        )


class BatchResponse(BaseModel):
    status_code: int
    request_id: str
    body: dict[str, Any]


class BatchError(BaseModel):
    code: str
    message: str


class BatchOutputLine(BaseModel):
    """One line of an OpenAI Batch output file."""

    id: str
    custom_id: str
    response: BatchResponse | None = None
    error: BatchError | None = None

    @classmethod
    def from_record(cls, record: ResultRecord) -> BatchOutputLine:
        """The output line for a finished job (failures carry an error object)."""
        line_id = f"batch_req_{record.job_id}"
        if record.status == "succeeded" and record.response is not None:
            body = record.response.model_dump(mode="json")
            body["mlxq_metrics"] = (
                record.metrics.model_dump(mode="json") if record.metrics else None
            )
            return cls(
                id=line_id,
                custom_id=record.custom_id,
                response=BatchResponse(status_code=200, request_id=record.job_id, body=body),
            )
        error = record.error or ErrorInfo(message="job failed without an error record")
        body: dict[str, Any] = {"error": error.model_dump(mode="json")}
        if record.partial is not None:  # stopped while it ran: what it made, cut
            body["mlxq_partial"] = record.partial.model_dump(mode="json")
        return cls(
            id=line_id,
            custom_id=record.custom_id,
            response=BatchResponse(
                status_code=record.status_code,
                request_id=record.job_id,
                body=body,
            ),
            error=BatchError(code=error.code, message=error.message),
        )

    @classmethod
    def missing(cls, job_id: str, custom_id: str, reason: str) -> BatchOutputLine:
        """The output line for a job that has no result (yet, or any more)."""
        return cls(
            id=f"batch_req_{job_id}",
            custom_id=custom_id,
            error=BatchError(code="no_result", message=reason),
        )


class BatchInputLine(BaseModel):
    """One line of an OpenAI Batch input file (the body is validated separately)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    custom_id: str = Field(min_length=1, max_length=512)
    method: Literal["POST"]
    url: Literal[
        "/v1/chat/completions",
        "/v1/embeddings",
        "/v1/responses",
        "/v1/completions",
        "/v1/messages",
        "/v1/audio/transcriptions",
        "/v1/audio/translations",
    ]
    body: dict[str, Any]
