"""Embedding jobs: taken together from their queue, embedded in shared forward passes,
each ended with its own record.

The worker loop hands the first embedding job here; the jobs right behind it in the
same queue that embed with the same model join it (up to :data:`MAX_JOBS` jobs and
:data:`MAX_INPUTS` inputs), so a file of 10,000 one-text jobs runs as full micro-batches,
not 10,000 forward passes. Every input of every job is tokenized and checked first (an
input too long for the model, a token id outside its vocabulary, ``dimensions`` the
model cannot give: that job alone fails with a 400); the rest are embedded together,
sorted by length (``worker.engine.embed``), under the worker's memory budget.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from schemas import (
    ContextLengthError,
    GenerationError,
    InvalidRequestError,
    MlxqError,
    ModelKindError,
    ResultRecord,
)
from schemas.embeddings import (
    Embedding,
    EmbeddingList,
    EmbeddingRequest,
    EmbeddingUsage,
    encode_base64,
)
from worker.engine.embed import TOKEN_BUDGET, Embedder, forward_bytes, shorten
from worker.engine.models import LoadedModel
from worker.lifecycle.held import Job
from worker.runner import records
from worker.runner.runtime import WorkerRuntime

log = logging.getLogger(__name__)

#: The most jobs, and inputs over them, embedded together.
MAX_JOBS = 1024
MAX_INPUTS = 4096


def is_embedding(job: Job) -> bool:
    return isinstance(job.envelope.request, EmbeddingRequest)


@dataclass
class _Ready:
    """A job whose inputs are tokenized and checked."""

    job: Job
    tokens: list[list[int]]
    model: LoadedModel
    load_time_s: float
    cache_hit: bool


def gather(
    first: Job, take: Callable[[], Job | None], give_back: Callable[[Job], None]
) -> list[Job]:
    """``first`` and the jobs ``take`` gives right after it that embed with the same model
    (the first that does not goes back with ``give_back``)."""
    jobs, inputs = [first], len(_request(first).inputs)
    model = _request(first).model
    while len(jobs) < MAX_JOBS and inputs < MAX_INPUTS:
        job = take()
        if job is None:
            break
        if not is_embedding(job) or _request(job).model != model:
            give_back(job)
            break
        jobs.append(job)
        inputs += len(_request(job).inputs)
    return jobs


def run_embeddings(jobs: list[Job], rt: WorkerRuntime) -> list[tuple[Job, ResultRecord]]:
    """The record of each job (one model: :func:`gather`'s). Whatever goes wrong becomes
    failed records; only BaseExceptions (a cold shutdown) escape."""
    ended: list[tuple[Job, ResultRecord]] = []
    ready: list[_Ready] = []
    for job in jobs:
        try:
            ready.append(_prepare(job, rt))
        except MlxqError as e:
            ended.append((job, records.failure(job, rt, e)))
    if not ready:
        return ended
    try:
        vectors = _embed(ready, rt)
    except MlxqError as e:
        return ended + [(r.job, records.failure(r.job, rt, e)) for r in ready]
    except Exception as e:  # never let one batch's surprise take the worker down
        log.exception("embedding %d job(s) failed unexpectedly", len(ready))
        error = GenerationError(f"{type(e).__name__}: {e}")
        return ended + [(r.job, records.failure(r.job, rt, error)) for r in ready]
    at = 0
    for r in ready:
        n = len(r.tokens)
        ended.append((r.job, _success(r, vectors[at : at + n], len(ready), rt)))
        at += n
    return ended


def _request(job: Job) -> EmbeddingRequest:
    req = job.envelope.request
    assert isinstance(req, EmbeddingRequest)
    return req


def _prepare(job: Job, rt: WorkerRuntime) -> _Ready:
    req = _request(job)
    rt.check_allowed(req.model)
    model, hit = rt.cache.get(req.model)
    embedder = model.embedder
    if embedder is None:
        send = "chat" if model.kind == "chat" else "transcription"
        a = "an" if model.kind == "audio" else "a"
        raise ModelKindError(
            f"model {req.model!r} is {a} {model.kind} model, not an embedding model (it has no "
            f"sentence-transformers pooling module): send it {send} requests"
        )
    _check_dimensions(req, embedder)
    raw = req.inputs
    texts = all(isinstance(x, str) for x in raw)
    tokens = embedder.tokenize(raw) if texts else [list(t) for t in raw]  # type: ignore[arg-type]
    for i, t in enumerate(tokens):
        if not t:
            raise InvalidRequestError(f"input {i} has no tokens")
        if not texts and embedder.vocab_size and max(t) >= embedder.vocab_size:
            raise InvalidRequestError(
                f"input {i}: token id {max(t)} is outside the vocabulary of {req.model!r} "
                f"({embedder.vocab_size} tokens)"
            )
        if embedder.context is not None and len(t) > embedder.context:
            if not req.truncate:
                raise ContextLengthError(
                    f"input {i} has {len(t)} tokens; {req.model!r} embeds at most "
                    f"{embedder.context} (set truncate: true to cut it)"
                )
            tokens[i] = t[: embedder.context]
    load = 0.0 if hit else model.load_time_s
    return _Ready(job, tokens, model, load, hit)


def _check_dimensions(req: EmbeddingRequest, embedder: Embedder) -> None:
    dims = embedder.pooling.dims
    if req.dimensions is None or req.dimensions == dims:
        return
    if req.dimensions > dims or not embedder.pooling.truncatable:
        why = (
            f"it gives {dims}"
            if req.dimensions > dims
            else f"it gives {dims} and was not trained for shorter vectors"
        )
        raise InvalidRequestError(
            f"dimensions={req.dimensions} is not available on {req.model!r} ({why})"
        )


def _embed(ready: list[_Ready], rt: WorkerRuntime) -> np.ndarray:
    embedder = ready[0].model.embedder
    assert embedder is not None
    tokens = [t for r in ready for t in r.tokens]
    longest = max(len(t) for t in tokens)
    rows = max(1, min(len(tokens), TOKEN_BUDGET // longest))
    need = forward_bytes(rows, longest, embedder.pooling.dims, embedder.heads)
    with rt.cache.reserving(need, f"{len(tokens)} input(s) to embed"):
        return embedder.embed(tokens)


def _success(r: _Ready, vectors: np.ndarray, together: int, rt: WorkerRuntime) -> ResultRecord:
    req = _request(r.job)
    embedder = r.model.embedder
    assert embedder is not None
    data = []
    for i, v in enumerate(vectors):
        if req.dimensions is not None and req.dimensions != len(v):
            v = shorten(v, req.dimensions, embedder.pooling.normalize)
        values = [float(x) for x in v]
        out = encode_base64(values) if req.encoding_format == "base64" else values
        data.append(Embedding(index=i, embedding=out))
    used = sum(len(t) for t in r.tokens)
    elapsed = r.job.started.elapsed()
    metrics = records.base_metrics(rt, r.job).model_copy(
        update={
            "load_time_s": r.load_time_s,
            "cache_hit": r.cache_hit,
            "prompt_tokens_per_s": used / elapsed if elapsed > 0 else None,
            "batch_size": together,
        }
    )
    return ResultRecord(
        job_id=r.job.id,
        batch_id=r.job.envelope.batch_id,
        custom_id=r.job.envelope.custom_id,
        status="succeeded",
        response=EmbeddingList(
            data=data, model=req.model, usage=EmbeddingUsage(prompt_tokens=used, total_tokens=used)
        ),
        metrics=metrics,
        finished_at=time.time(),
    )
