"""A small Python API for apps that submit jobs and read results from code."""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from pydantic import BaseModel
from redis import Redis

from producer.batches import (
    BatchStatus,
    batch_job_ids,
    batch_status,
    cancel_batch,
    is_cancelled,
    page_outcomes,
    wait_for_batch,
)
from producer.fleet import live_workers
from producer.retry import RetryFilter, RetryReport, retry_batch
from producer.streams import chunk_text, iter_chunks
from producer.submit import DEFAULT_JOB_TIMEOUT, SubmitItem, SubmitSummary, submit_items
from schemas import ChatRequest, ResultRecord, keys
from schemas.audio import AudioInvalid, TranscriptionRequest, check_file
from schemas.connect import redis_from_url
from schemas.embeddings import JobRequest, parse_request
from schemas.fleet import WorkerInfo
from schemas.images import ImageInvalid, check_images
from schemas.responses import TranslationError
from schemas.settings import DEFAULT_REDIS_URL
from schemas.shapes import SHAPED_URLS, to_chat_job
from schemas.store import read_result


class Client:
    """Submit chat requests to mlxq and collect their results.

    >>> client = Client("redis://localhost:6379/0")
    >>> summary = client.submit([{"model": "m", "messages": [{"role": "user", "content": "hi"}]}])
    >>> client.wait(summary.batch_id)
    >>> client.results(summary.batch_id)
    """

    def __init__(
        self,
        redis_url: str = DEFAULT_REDIS_URL,
        *,
        connection: Redis | None = None,
        queue: str = keys.DEFAULT_QUEUE,
    ) -> None:
        self.connection = connection or redis_from_url(redis_url)
        self.queue = queue

    def submit(
        self,
        requests: Iterable[JobRequest | Mapping[str, Any]] | Mapping[str, JobRequest | Mapping],
        *,
        batch_id: str | None = None,
        job_timeout: int = DEFAULT_JOB_TIMEOUT,
        result_ttl: int = keys.DEFAULT_RESULT_TTL,
        route: str = "queue",
        tenant: str = keys.DEFAULT_TENANT,
        priority: int = 0,
        endpoint: str | None = None,
    ) -> SubmitSummary:
        """Submit requests as one batch. A mapping gives custom ids; else they are ``req-N``.
        A request is a chat request, or an embeddings one (a body with ``input``). The
        batch belongs to ``tenant``: workers share each queue fairly between tenants, and
        take a tenant's batches of higher ``priority`` (-9 to 9) first. With ``endpoint``
        ``"/v1/responses"``, ``"/v1/completions"`` or ``"/v1/messages"`` (Anthropic's), the
        requests are bodies of that endpoint: each runs as a chat job, and the batch's output lines
        (:func:`producer.iter_output_lines`) carry the endpoint's own objects.

        Every request is validated before anything is enqueued (pydantic's
        ValidationError names the field).
        """
        pairs = (
            requests.items()
            if isinstance(requests, Mapping)
            else ((f"req-{i}", r) for i, r in enumerate(requests, start=1))
        )
        if endpoint is not None and endpoint not in SHAPED_URLS:
            raise ValueError(f"endpoint: {endpoint!r} is not one of {', '.join(SHAPED_URLS)}")
        items = [_item(str(cid), r, endpoint) for cid, r in pairs]  # all validated first
        return submit_items(
            self.connection,
            items,
            batch_id=batch_id,
            queue=keys.tenant_queue(self.queue, tenant, priority),
            job_timeout=job_timeout,
            result_ttl=result_ttl,
            source="python-api",
            route=route,
        )

    def result(self, job_id: str) -> ResultRecord | None:
        """The job's result record, or None while it has none. A job of a cancelled batch
        that never started gets a ``cancelled`` record (workers write none for it)."""
        batch_id = keys.batch_of(job_id)
        if not is_cancelled(self.connection, batch_id):
            return read_result(self.connection, job_id)
        outcome = page_outcomes(self.connection, batch_id, [job_id], cancelled=True)[0]
        return outcome if isinstance(outcome, ResultRecord) else None

    def wait_result(self, job_id: str, timeout: float = 600.0, poll_s: float = 0.2) -> ResultRecord:
        """Block until the job has a result record; TimeoutError after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while (record := self.result(job_id)) is None:
            if time.monotonic() >= deadline:
                raise TimeoutError(f"job {job_id}: no result after {timeout}s")
            time.sleep(poll_s)
        return record

    def status(self, batch_id: str) -> BatchStatus:
        """Queued / running / succeeded / failed counts of a batch."""
        return batch_status(self.connection, batch_id)

    def wait(self, batch_id: str, timeout: float | None = None) -> BatchStatus:
        """Block until every job of the batch has ended."""
        return wait_for_batch(self.connection, batch_id, timeout=timeout)

    def stream(self, job_id: str, timeout: float | None = None) -> Iterator[str]:
        """The text of a ``stream: true`` job as it is generated (pieces, in order)."""
        for chunk in iter_chunks(self.connection, job_id, timeout=timeout):
            if chunk.get("error"):
                raise RuntimeError(f"job {job_id} failed: {chunk['error'].get('message')}")
            if text := chunk_text(chunk):
                yield text

    def cancel(self, batch_id: str) -> tuple[int, int]:
        """Cancel the batch's queued jobs: (cancelled, still running)."""
        return cancel_batch(self.connection, batch_id)

    def retry(
        self,
        batch_id: str,
        status_codes: tuple[str, ...] = (),
        error_codes: tuple[str, ...] = (),
    ) -> RetryReport:
        """Run the batch's failed jobs again (those matching the filters: ``("5xx",)``,
        ``("model_load_error",)``); see ``producer retry``. Safe to call twice."""
        return retry_batch(self.connection, batch_id, RetryFilter(status_codes, error_codes))

    def fleet(self) -> list[WorkerInfo]:
        """The live workers and what they report."""
        return live_workers(self.connection)

    def results(self, batch_id: str) -> list[ResultRecord | None]:
        """Result records of the batch in submission order (None for jobs not ended).
        For a large batch, :meth:`iter_results` keeps one page in memory instead."""
        return list(self.iter_results(batch_id))

    def iter_results(self, batch_id: str) -> Iterator[ResultRecord | None]:
        """Result records of the batch in submission order (None for jobs not ended),
        read a page (one round trip) at a time; jobs of a cancelled batch that never
        started get a ``cancelled`` record."""
        cancelled = is_cancelled(self.connection, batch_id)
        for page in batch_job_ids(self.connection, batch_id):
            for outcome in page_outcomes(self.connection, batch_id, page, cancelled):
                yield outcome if isinstance(outcome, ResultRecord) else None


def _item(custom_id: str, request: Any, endpoint: str | None) -> SubmitItem:
    """One request as a submit item: a chat or embeddings request, or a body of
    ``endpoint`` translated to its chat job (a bad one raises ValueError naming it)."""
    if endpoint is None:
        parsed = request if isinstance(request, BaseModel) else parse_request(request)
        if isinstance(parsed, TranscriptionRequest):  # an inline recording: checked here
            body = parsed.model_dump(mode="json", exclude_unset=True)
            try:
                check_file(body)
            except AudioInvalid as e:
                raise AudioInvalid(f"{custom_id}: {e}") from None
            return SubmitItem(custom_id, parsed, body)
        if not isinstance(parsed, ChatRequest):
            return SubmitItem(custom_id, parsed)
        if isinstance(request, Mapping):
            _images_ok(custom_id, dict(request))
            return SubmitItem(custom_id, parsed)
        # the body the job stores (what ``submit_items`` would dump): dumped once, checked
        body = parsed.model_dump(mode="json", exclude_unset=True, by_alias=True)
        _images_ok(custom_id, body)
        return SubmitItem(custom_id, parsed, body)
    if isinstance(request, BaseModel):
        request = request.model_dump(mode="json", exclude_unset=True)
    try:
        body, shape = to_chat_job(endpoint, request)
    except TranslationError as e:
        raise ValueError(f"{custom_id}: {e}") from None
    _images_ok(custom_id, body)
    return SubmitItem(custom_id, ChatRequest.model_validate(body), body, shape)


def _images_ok(custom_id: str, body: dict[str, Any]) -> None:
    """Raise :class:`schemas.images.ImageInvalid` (a ValueError) naming ``custom_id`` and
    the part, for an inline image no worker would read."""
    try:
        check_images(body)
    except ImageInvalid as e:
        raise ImageInvalid(f"{custom_id}: {e}") from None
