"""Anthropic's Message Batches API over mlxq batches: create, retrieve, list, cancel,
results, delete.

A message batch *is* an mlxq batch (``mlxq:batch:<id>``, same counters, tenant,
priority, progress, retry and ``/ui`` view), created from the request's inline
``requests`` (``{custom_id, params}``). Each request is checked as ``producer submit``
checks a line (``producer.lines``: the params translated into a chat job by
``schemas.anthropic``, its output translated back, ``schemas.shapes``); one bad request
refuses the whole batch with a 400 naming it, and nothing is enqueued. Its results are
read from the batch's records whenever asked: one JSONL line per request,
``{custom_id, result: {type: succeeded | errored | canceled | expired, ...}}``.
"""

from __future__ import annotations

import json
import re
import tempfile
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any

from fastapi import FastAPI, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse, Response, StreamingResponse
from redis import Redis

from producer.batches import batch_status, cancel_batch, iter_output_lines
from producer.jobsfile import check_file, enqueue_file
from producer.lines import Defaults
from producer.serve.messages import error
from producer.serve.settings import GatewaySettings
from producer.webhooks import emit
from schemas import keys
from schemas.anthropic import error_body
from schemas.cancel import CANCELLED_AT
from schemas.shapes import MESSAGES_URL

#: A message batch's window (Anthropic's): past it, what has not run is expired.
WINDOW_S = 24 * 3600
#: The most requests one batch holds (Anthropic's limit).
MAX_REQUESTS = 100_000
_CUSTOM_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")
#: mlxq error codes that are Anthropic's ``invalid_request_error`` (the rest: api_error).
_INVALID = ("invalid_request", "model_not_found", "context_length_exceeded", "invalid_image")


def _iso(ts: float | str | None) -> str | None:
    if ts in (None, ""):
        return None
    return datetime.fromtimestamp(float(ts), UTC).isoformat().replace("+00:00", "Z")


def create(
    conn: Redis, requests: list[Any], settings: GatewaySettings, tenant: str
) -> str | tuple[int, str]:
    """Check every request and enqueue them as one batch (its id), or (400, what is wrong
    with the first bad request; nothing enqueued)."""
    if not isinstance(requests, list) or not 0 < len(requests) <= MAX_REQUESTS:
        return 400, f"requests: give 1 to {MAX_REQUESTS} requests"
    errors: list[str] = []
    with tempfile.TemporaryDirectory(prefix="mlxq-msgbatch-") as tmp:
        path = Path(tmp) / "requests.jsonl"
        with open(path, "w") as out:
            for i, item in enumerate(requests):
                cid = item.get("custom_id") if isinstance(item, dict) else None
                if not isinstance(cid, str) or not _CUSTOM_ID.fullmatch(cid):
                    return 400, f"requests.{i}.custom_id: 1 to 64 of A-Z a-z 0-9 _ -"
                out.write(json.dumps(item, separators=(",", ":")) + "\n")

        def on_error(lineno: int, message: str, _text: str) -> None:
            errors.append(f"requests.{lineno - 1}.{message}")

        defaults = Defaults(endpoint=MESSAGES_URL)
        checked = check_file(path, defaults, on_error)
        if errors:
            more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
            return 400, errors[0] + more
        batch_id = f"msgbatch_{uuid.uuid4().hex[:24]}"
        queue = keys.tenant_queue(settings.queue, tenant)
        enqueue_file(
            conn,
            checked,
            defaults,
            batch_id=batch_id,
            queue=queue,
            job_timeout=settings.job_timeout,
            result_ttl=settings.result_ttl,
            source="gateway:message_batches",
            wait_replicas=settings.wait_replicas,
        )
    now = time.time()
    with conn.pipeline() as pipe:
        pipe.hset(keys.batch_key(batch_id), "endpoint", MESSAGES_URL)  # (tenant: its queue's)
        pipe.zadd(keys.message_batches_key(None), {batch_id: now})
        pipe.zadd(keys.message_batches_key(tenant), {batch_id: now})
        pipe.execute()
    return batch_id


def batch_object(
    conn: Redis, batch_id: str, base: str, tenant: str | None
) -> dict[str, Any] | None:
    """Anthropic's ``message_batch`` for an mlxq batch made here (None: no such batch, not
    a message batch, or another ``tenant``'s)."""
    meta = {k.decode(): v.decode() for k, v in conn.hgetall(keys.batch_key(batch_id)).items()}
    if meta.get("endpoint") != MESSAGES_URL:
        return None
    if tenant is not None and meta.get("tenant", keys.DEFAULT_TENANT) != tenant:
        return None
    created = float(meta.get("created_at") or 0)
    s = batch_status(conn, batch_id)
    if s.cancelled_at is None and not s.finished and time.time() > created + WINDOW_S:
        if conn.hsetnx(keys.batch_key(batch_id), "expired_at", time.time()):
            emit(conn, batch_id, "batch.expired")
        cancel_batch(conn, batch_id, event=None)
        return batch_object(conn, batch_id, base, tenant)
    expired = bool(meta.get("expired_at"))
    ended = s.finished or (s.cancelled_at is not None and s.running == 0)
    status = "ended" if ended else ("canceling" if s.cancelled_at is not None else "in_progress")
    stopped = s.cancelled + (s.total - s.done if ended else 0)
    counts = {
        "processing": 0 if ended else s.total - s.done,
        "succeeded": s.succeeded,
        "errored": s.failed,
        "canceled": 0 if expired else stopped,
        "expired": stopped if expired else 0,
    }
    last = meta.get("last_done_at") or meta.get(CANCELLED_AT)
    return {
        "id": batch_id,
        "type": "message_batch",
        "processing_status": status,
        "request_counts": counts,
        "ended_at": _iso(last) if ended else None,
        "created_at": _iso(created),
        "expires_at": _iso(created + WINDOW_S),
        "archived_at": None,
        "cancel_initiated_at": _iso(meta.get(CANCELLED_AT)),
        "results_url": f"{base}/v1/messages/batches/{batch_id}/results" if ended else None,
    }


def results(conn: Redis, batch_id: str) -> Iterator[bytes]:
    """The batch's results, a JSONL line per ended request, in submission order."""
    expired = bool(conn.hexists(keys.batch_key(batch_id), "expired_at"))
    for line in iter_output_lines(conn, batch_id):
        if isinstance(line, str):
            continue  # not ended yet
        response = line.response
        if line.error is None and response is not None:
            message = dict(response.body)
            message.pop("mlxq_metrics", None)
            result: dict[str, Any] = {"type": "succeeded", "message": message}
        elif line.error is not None and line.error.code == "cancelled":
            result = {"type": "expired" if expired else "canceled"}
        else:
            assert line.error is not None
            status = 400 if line.error.code in _INVALID else 500
            result = {"type": "errored", "error": error_body(status, line.error.message)}
        yield (json.dumps({"custom_id": line.custom_id, "result": result}) + "\n").encode()


def delete(conn: Redis, batch_id: str) -> None:
    """Forget an ended batch (its records expire with their TTL)."""
    raw = conn.hget(keys.batch_key(batch_id), "tenant")
    tenant = raw.decode() if raw else keys.DEFAULT_TENANT
    with conn.pipeline() as pipe:
        pipe.delete(keys.batch_key(batch_id))
        pipe.zrem(keys.BATCHES, batch_id)
        pipe.zrem(keys.tenant_batches_key(tenant), batch_id)
        pipe.zrem(keys.message_batches_key(None), batch_id)
        pipe.zrem(keys.message_batches_key(tenant), batch_id)
        pipe.execute()


def list_batches(
    conn: Redis,
    base: str,
    scope: str | None,
    limit: int,
    after_id: str | None = None,
    before_id: str | None = None,
) -> dict[str, Any]:
    """A page of ``scope``'s message batches (every tenant's: None), newest first: after
    ``after_id``, or the ``limit`` just newer than ``before_id``. Ids whose batch expired
    are dropped from the index on the way."""
    index = keys.message_batches_key(scope)
    ids = [i.decode() for i in conn.zrevrange(index, 0, -1)]  # (message batches only)
    if after_id in ids:
        ids = ids[ids.index(after_id) + 1 :]
    backwards = before_id is not None and before_id in ids
    if backwards:  # the nearest newer first, put back in order below
        ids = ids[: ids.index(before_id)][::-1]
    data: list[dict[str, Any]] = []
    gone: list[str] = []
    for batch_id in ids:
        if len(data) > limit:
            break
        obj = batch_object(conn, batch_id, base, scope)
        if obj is not None:
            data.append(obj)
        elif not conn.exists(keys.batch_key(batch_id)):
            gone.append(batch_id)
    if gone:
        conn.zrem(index, *gone)
    out = data[:limit][::-1] if backwards else data[:limit]
    return {
        "data": out,
        "has_more": len(data) > limit,
        "first_id": out[0]["id"] if out else None,
        "last_id": out[-1]["id"] if out else None,
    }


def routes(app: FastAPI, s: GatewaySettings) -> None:
    """``/v1/messages/batches`` and its sub-routes, answering in Anthropic's shapes."""

    def _scope(request: Request) -> str | None:
        return s.scope_of(request.headers.get("authorization"))

    def _base(request: Request) -> str:
        return str(request.base_url).rstrip("/")

    async def _found(request: Request, batch_id: str) -> dict[str, Any] | Response:
        obj = await run_in_threadpool(
            batch_object, request.app.state.redis, batch_id, _base(request), _scope(request)
        )
        return obj if obj is not None else error(404, f"no message batch {batch_id!r}")

    @app.post("/v1/messages/batches")
    async def create_batch(request: Request) -> Response:
        try:
            body = json.loads(await request.body())
        except (ValueError, UnicodeDecodeError) as e:
            return error(400, f"the body is not valid JSON: {e}")
        if not isinstance(body, dict) or set(body) != {"requests"}:
            return error(400, "the body must be an object with requests (and nothing else)")
        tenant = s.tenant_of(request.headers.get("authorization"))
        got = await run_in_threadpool(create, request.app.state.redis, body["requests"], s, tenant)
        if isinstance(got, tuple):
            return error(*got)
        found = await _found(request, got)
        return found if isinstance(found, Response) else JSONResponse(found)

    @app.get("/v1/messages/batches/{batch_id}")
    async def retrieve_batch(request: Request, batch_id: str) -> Response:
        found = await _found(request, batch_id)
        return found if isinstance(found, Response) else JSONResponse(found)

    @app.get("/v1/messages/batches")
    async def listing(
        request: Request,
        limit: Annotated[int, Query(ge=1, le=1000)] = 20,
        after_id: str | None = None,
        before_id: str | None = None,
    ) -> Response:
        args = (_base(request), _scope(request), limit, after_id, before_id)
        return JSONResponse(await run_in_threadpool(list_batches, request.app.state.redis, *args))

    @app.post("/v1/messages/batches/{batch_id}/cancel")
    async def cancel(request: Request, batch_id: str) -> Response:
        found = await _found(request, batch_id)
        if isinstance(found, Response):
            return found
        await run_in_threadpool(cancel_batch, request.app.state.redis, batch_id)
        return await retrieve_batch(request, batch_id)

    async def _ended(request: Request, batch_id: str, why: str) -> dict[str, Any] | Response:
        """The batch if it has ended, else the 400 saying ``why`` it must have."""
        found = await _found(request, batch_id)
        if isinstance(found, Response) or found["processing_status"] == "ended":
            return found
        return error(400, f"message batch {batch_id!r} has not ended: {why}")

    @app.get("/v1/messages/batches/{batch_id}/results")
    async def batch_results(request: Request, batch_id: str) -> Response:
        found = await _ended(request, batch_id, "no results yet")
        if isinstance(found, Response):
            return found
        lines = results(request.app.state.redis, batch_id)
        return StreamingResponse(lines, media_type="application/x-jsonl")

    @app.delete("/v1/messages/batches/{batch_id}")
    async def delete_batch(request: Request, batch_id: str) -> Response:
        found = await _ended(request, batch_id, "cancel it first")
        if isinstance(found, Response):
            return found
        await run_in_threadpool(delete, request.app.state.redis, batch_id)
        return JSONResponse({"id": batch_id, "type": "message_batch_deleted"})
