"""OpenAI's Batch API over mlxq batches: create from an uploaded file, read, list, cancel.

A Batch API batch *is* an mlxq batch (``mlxq:batch:<id>``, same counters, same
``producer status`` / ``results``), with the Batch API's fields on the same hash
(``input_file_id``, ``endpoint``, ``completion_window``, ``metadata``,
``gw_status``, ``errors``). Creating one answers at once with status
``validating``; a task then checks every line of the file with ``producer
submit``'s rules and either fails the batch with the line errors or enqueues it
(status ``in_progress``). Everything after that is read from the batch's
counters, so any gateway process answers for any batch.
"""

from __future__ import annotations

import json
import logging
import tempfile
import time
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from redis import Redis

from producer.batches import batch_status, cancel_batch
from producer.jobsfile import check_file, enqueue_file
from producer.lines import Defaults
from producer.serve.files import iter_output_file, output_file_id, spool_upload
from producer.serve.settings import GatewaySettings
from producer.submit import BatchCancelledError, new_batch_id
from producer.webhooks import emit
from schemas import keys
from schemas.cancel import CANCELLED_AT

log = logging.getLogger(__name__)

WINDOW_S = {"24h": 24 * 3600}
#: A validating gateway's claim on a batch lasts this long unless renewed (it renews a
#: third of the way): when a gateway dies mid-validation, another one takes over after it.
LOCK_S = 30
#: Line errors kept on a failed batch (OpenAI's ``errors.data``); the count says the rest.
MAX_ERRORS = 1000


class BatchCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    input_file_id: str = Field(min_length=1, max_length=128)
    endpoint: Literal[
        "/v1/chat/completions",
        "/v1/embeddings",
        "/v1/responses",
        "/v1/completions",
        "/v1/audio/transcriptions",
        "/v1/audio/translations",
    ]
    completion_window: Literal["24h"]
    metadata: dict[str, str] | None = Field(default=None, max_length=16)


def create(
    conn: Redis, body: BatchCreate, settings: GatewaySettings, tenant: str = keys.DEFAULT_TENANT
) -> str:
    """Register a batch in status ``validating``; the caller then runs :func:`validate`.
    Its jobs go to ``tenant``'s list of the gateway's queue (fair share)."""
    batch_id, now = new_batch_id(), time.time()
    fields = {
        "batch_id": batch_id,
        "created_at": now,
        "queue": keys.tenant_queue(settings.queue, tenant),
        "tenant": tenant,
        "result_ttl": settings.result_ttl,
        "total": 0,
        "input_file_id": body.input_file_id,
        "endpoint": body.endpoint,
        "completion_window": body.completion_window,
        "metadata": json.dumps(body.metadata) if body.metadata is not None else "",
        "gw_status": "validating",
        "source": f"gateway:{body.input_file_id}",
    }
    with conn.pipeline() as pipe:
        pipe.hset(keys.batch_key(batch_id), mapping=fields)
        pipe.expire(keys.batch_key(batch_id), settings.result_ttl)
        pipe.zadd(keys.BATCHES, {batch_id: now})
        pipe.zadd(keys.tenant_batches_key(tenant), {batch_id: now})
        pipe.execute()
    return batch_id


def _lock_key(batch_id: str) -> str:
    return f"{keys.batch_key(batch_id)}:validating"


def claim(conn: Redis, batch_id: str) -> bool:
    """Take the right to validate the batch (for ``LOCK_S``, renewed while it runs): at
    creation, or when the gateway that held it died (its lock expired) and the batch is
    still ``validating``. Validating twice is harmless: the enqueue skips present jobs."""
    if conn.hget(keys.batch_key(batch_id), "gw_status") != b"validating":
        return False
    return bool(conn.set(_lock_key(batch_id), "1", nx=True, ex=LOCK_S))


def validate(
    conn: Redis, batch_id: str, file_id: str, settings: GatewaySettings, endpoint: str
) -> None:
    """Check every line of the batch's file; fail the batch with the line errors, or
    enqueue it. Runs in a thread of the gateway process that :func:`claim`-ed the batch,
    renewing the claim as it goes."""
    key = keys.batch_key(batch_id)
    errors: list[dict[str, Any]] = []
    count = 0
    renewed = time.monotonic()

    def renew(_: int) -> None:
        nonlocal renewed
        if time.monotonic() - renewed > LOCK_S / 3:
            conn.expire(_lock_key(batch_id), LOCK_S)
            renewed = time.monotonic()

    def on_error(lineno: int, message: str, _text: str) -> None:
        nonlocal count
        count += 1
        if len(errors) < MAX_ERRORS:
            errors.append(
                {"code": "invalid_line", "message": message, "param": None, "line": lineno}
            )

    with tempfile.TemporaryDirectory(prefix="mlxq-gateway-") as tmp:
        path = Path(tmp) / "input.jsonl"
        try:
            spool_upload(conn, file_id, path)
            defaults = Defaults(endpoint=endpoint)
            checked = check_file(path, defaults, on_error, progress=renew)
            if not count and not checked.valid:
                on_error(0, "the file has no requests", "")
            if count:
                return _fail(conn, key, errors, count)
            enqueue_file(
                conn,
                checked,
                defaults,
                batch_id=batch_id,
                queue=(conn.hget(key, "queue") or settings.queue.encode()).decode(),
                job_timeout=settings.job_timeout,
                result_ttl=settings.result_ttl,
                source=f"gateway:{file_id}",
                progress=renew,
                wait_replicas=settings.wait_replicas,
            )
        except BatchCancelledError:
            conn.hset(key, "gw_status", "enqueued")
            return
        except Exception as e:  # the batch must not stay "validating" forever
            log.exception("batch %s: validation failed", batch_id)
            return _fail(conn, key, [{"code": "server_error", "message": str(e), "line": None}], 1)
    conn.hset(key, mapping={"gw_status": "enqueued", "in_progress_at": time.time()})
    conn.delete(_lock_key(batch_id))


def _fail(conn: Redis, key: str, errors: list[dict[str, Any]], count: int) -> None:
    if count > len(errors):
        errors.append(
            {"code": "too_many_errors", "message": f"{count} invalid lines in all", "line": None}
        )
    conn.hset(
        key,
        mapping={"gw_status": "failed", "failed_at": time.time(), "errors": json.dumps(errors)},
    )
    emit(conn, key.rsplit(":", 1)[-1], "batch.failed")


def cancel(conn: Redis, batch_id: str) -> None:
    """Cancel a batch (O(1): ``producer cancel``); one still validating is never enqueued."""
    key = keys.batch_key(batch_id)
    if conn.hget(key, "gw_status") == b"validating":
        if conn.hsetnx(key, CANCELLED_AT, repr(time.time())):
            emit(conn, batch_id, "batch.cancelled")
        return
    cancel_batch(conn, batch_id)


def batch_object(conn: Redis, batch_id: str, tenant: str | None = None) -> dict[str, Any] | None:
    """OpenAI's Batch object for an mlxq batch (None if there is none, or if ``tenant`` is
    given and the batch is another tenant's: to a key of another tenant it does not exist)."""
    raw = conn.hgetall(keys.batch_key(batch_id))
    if not raw:
        return None
    meta = {k.decode(): v.decode() for k, v in raw.items()}
    if tenant is not None and meta.get("tenant", keys.DEFAULT_TENANT) != tenant:
        return None
    created = float(meta.get("created_at", 0))
    window = meta.get("completion_window") or "24h"
    expires = created + WINDOW_S.get(window, WINDOW_S["24h"])
    obj: dict[str, Any] = {
        "id": batch_id,
        "object": "batch",
        "endpoint": meta.get("endpoint") or "/v1/chat/completions",
        "errors": None,
        "input_file_id": meta.get("input_file_id", ""),
        "completion_window": window,
        "status": "in_progress",
        "output_file_id": None,
        "error_file_id": None,
        "created_at": int(created),
        "in_progress_at": _ts(meta.get("in_progress_at")),
        "expires_at": int(expires),
        "finalizing_at": None,
        "completed_at": None,
        "failed_at": _ts(meta.get("failed_at")),
        "expired_at": _ts(meta.get("expired_at")),
        "cancelling_at": _ts(meta.get(CANCELLED_AT)),
        "cancelled_at": None,
        "request_counts": {"total": 0, "completed": 0, "failed": 0},
        "metadata": json.loads(meta["metadata"]) if meta.get("metadata") else None,
    }
    gw = meta.get("gw_status")
    if gw == "failed":
        errors = json.loads(meta.get("errors") or "[]")
        return obj | {"status": "failed", "errors": {"object": "list", "data": errors}}
    if gw == "validating":
        return obj | {"status": "cancelling" if meta.get(CANCELLED_AT) else "validating"}
    s = batch_status(conn, batch_id)
    obj["request_counts"] = {
        "total": s.total,
        "completed": s.succeeded,
        "failed": s.failed + s.cancelled,
    }
    if s.cancelled_at is None and not s.finished and time.time() > expires:
        if conn.hsetnx(keys.batch_key(batch_id), "expired_at", time.time()):
            emit(conn, batch_id, "batch.expired")
        cancel_batch(conn, batch_id, event=None)  # OpenAI ends a batch at its window
        return batch_object(conn, batch_id)
    ended_at = _ts(meta.get("last_done_at")) or _ts(meta.get(CANCELLED_AT))
    if s.cancelled_at is not None and s.running == 0:
        status = "expired" if meta.get("expired_at") else "cancelled"
        obj["cancelled_at"] = ended_at if status == "cancelled" else None
    elif s.cancelled_at is not None:
        status = "expired" if meta.get("expired_at") else "cancelling"
    elif s.finished:
        status = "completed"
        obj["completed_at"] = obj["finalizing_at"] = ended_at
    else:
        status = "in_progress"
    obj["status"] = status
    if status in ("completed", "cancelled", "expired"):
        if s.succeeded:
            obj["output_file_id"] = output_file_id(batch_id, errors=False)
        if s.failed + s.cancelled:
            obj["error_file_id"] = output_file_id(batch_id, errors=True)
    return obj


def output_file_meta(
    conn: Redis, batch_id: str, errors: bool, tenant: str | None = None
) -> dict[str, Any] | None:
    """The File metadata of a batch's output or error file (None: no such batch, or
    another ``tenant``'s). Its size is counted by making the file; once the batch has
    ended it is kept on the batch."""
    obj = batch_object(conn, batch_id, tenant)
    if obj is None:
        return None
    field = "err_bytes" if errors else "out_bytes"
    cached = conn.hget(keys.batch_key(batch_id), field)
    size = int(cached) if cached else sum(len(x) for x in iter_output_file(conn, batch_id, errors))
    if not cached and obj["status"] in ("completed", "cancelled", "expired", "failed"):
        conn.hset(keys.batch_key(batch_id), field, size)
    return {
        "id": output_file_id(batch_id, errors),
        "filename": f"{batch_id}_{'error' if errors else 'output'}.jsonl",
        "purpose": "batch_output",
        "bytes": size,
        "created_at": obj["completed_at"] or obj["cancelled_at"] or obj["created_at"],
    }


def list_batches(
    conn: Redis, limit: int, after: str | None, tenant: str | None = None
) -> dict[str, Any]:
    """Batches newest first, ``limit`` per page, after the batch id ``after`` (only
    ``tenant``'s, read from its own set, if given). Expired batches met on the way are
    dropped from the sets."""
    index = keys.BATCHES if tenant is None else keys.tenant_batches_key(tenant)
    start = 0
    if after:
        rank = conn.zrevrank(index, after)
        start = rank + 1 if rank is not None else 0
    data: list[dict[str, Any]] = []
    gone: list[str] = []
    while len(data) < limit + 1:
        ids = conn.zrevrange(index, start, start + limit)
        if not ids:
            break
        start += len(ids)
        for raw in ids:
            obj = batch_object(conn, raw.decode(), tenant)
            if obj is None and not conn.exists(keys.batch_key(raw.decode())):
                gone.append(raw.decode())
            elif obj is not None and len(data) < limit + 1:
                data.append(obj)
    for key, members in keys.gone_batches(gone, tenant):
        conn.zrem(key, *members)
    page = data[:limit]
    return {
        "object": "list",
        "data": page,
        "first_id": page[0]["id"] if page else None,
        "last_id": page[-1]["id"] if page else None,
        "has_more": len(data) > limit,
    }


def _ts(value: str | None) -> int | None:
    return int(float(value)) if value else None
