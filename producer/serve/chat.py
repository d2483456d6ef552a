"""Chat completions through the queue: enqueue one job, wait for its record or relay its stream.

A chat completion is an mlxq batch of one job (``chat_<hex>``) on the interactive
queue. The batch names its gateway process's notify list, and the process's one
reader (:mod:`producer.serve.notify`) brings the record to the waiting request,
which checks once a second whether its client went away: a client that
disconnects cancels its job (the batch flag: a worker drops it unstarted, or stops it
at its next step with a ``cancelled`` record; a stream whose reader goes away alike).
With
``"stream": true`` the job writes ``chat.completion.chunk`` objects to its Redis
stream and the gateway relays them as server-sent events, ending with
``data: [DONE]``; until the first chunk arrives nothing is sent, so a job that
fails before generating (unknown model, say) still gets its HTTP status.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Protocol

from redis.asyncio import Redis as AsyncRedis
from starlette.requests import Request

from producer.enqueue import Prepared, enqueue_call
from producer.serve.notify import Notifier
from producer.serve.settings import GatewaySettings
from schemas import job_data, keys
from schemas.cancel import CANCELLED_AT

#: Longest single blocking read (seconds): how often a gone client is noticed.
WAIT_S = 1


def new_job_id() -> str:
    """A chat completion's job id: the one job of a new batch ``chat_<20 hex>``."""
    return keys.job_id_for(f"chat_{secrets.token_hex(10)}", "chat")


async def enqueue(
    script: Callable[..., Awaitable[Any]],
    job_id: str,
    body: dict[str, Any],
    s: GatewaySettings,
    notify: str = "",
    tenant: str = keys.DEFAULT_TENANT,
) -> bool:
    """Enqueue the request as a batch of one on the interactive queue, in one call of
    ``script`` (:data:`producer.enqueue.ENQUEUE_LUA`: this process's
    :class:`~producer.serve.coalesce.Coalesced` calls, or an ``AsyncScript``). False if
    ``max_interactive`` jobs already wait (on the list of the key's ``tenant``: the
    interactive queue's own, or ``<queue>@<tenant>``, shared fairly by the take).
    ``notify``: the list its record is announced on (this process's
    :class:`~producer.serve.notify.Notifier`).
    Chat batches stay out of ``mlxq:batches``: they are not Batch API batches."""
    job = Prepared(
        job_id,
        keys.tenant_queue(s.interactive_queue, tenant),  # a key's tenant: its own list
        job_data("chat", time.time(), body, s.chat_ttl),
        "chat",
        model=str(body.get("model", "")),
    )
    script_keys, args = enqueue_call(
        keys.batch_of(job_id),
        [job],
        s.chat_ttl,
        s.job_timeout,
        most=s.max_interactive,
        notify=notify,
    )
    # -1: the interactive queue is full (checked and refused in the same script)
    return await script(keys=script_keys, args=args) != -1


async def cancel(conn: AsyncRedis, job_id: str, ttl: int) -> bool:
    """Cancel a job nobody is waiting for any more, unless it has ended: unstarted, no
    worker starts it; running, its worker stops it at its next step."""
    if await conn.exists(keys.result_key(job_id)):
        return False
    batch = keys.batch_key(keys.batch_of(job_id))
    await conn.hsetnx(batch, CANCELLED_AT, repr(time.time()))
    await conn.expire(batch, ttl)
    return True


async def wait_record(
    conn: AsyncRedis,
    notifier: Notifier,
    future: asyncio.Future[dict[str, Any] | None],
    job_id: str,
    ttl: int,
) -> dict[str, Any] | None:
    """The job's record (its JSON, not re-validated: a worker wrote it through the
    ResultRecord model), or None if the client went away or its time ran out (the job
    is then cancelled). ``future``: ``notifier.expect(job_id,
    ...)``, called before the job was enqueued."""
    try:
        record = await future
    finally:
        notifier.forget(job_id)
    if record is None:
        await cancel(conn, job_id, ttl)
    return record


async def first_chunks(
    conn: AsyncRedis, job_id: str, request: Request, timeout_s: float, ttl: int
) -> tuple[list[dict[str, Any]], str, dict[str, Any] | None]:
    """Wait for the job's first stream chunks: (chunks, last stream id, record if the job
    ended without streaming). ([], "", None): the client went away or the wait timed out."""
    key, waited = keys.stream_key(job_id), 0.0
    while True:
        reply = await conn.xread({key: "0-0"}, block=WAIT_S * 1000, count=500)
        if reply:
            entries = reply[0][1]
            return [json.loads(f[b"chunk"]) for _, f in entries], entries[-1][0].decode(), None
        raw = await conn.get(keys.result_key(job_id))
        if raw is not None and not await conn.exists(key):
            return [], "", json.loads(raw)
        waited += WAIT_S
        if waited >= timeout_s or await request.is_disconnected():
            await cancel(conn, job_id, ttl)
            return [], "", None


def is_last(chunk: dict[str, Any]) -> bool:
    return bool(chunk.get("error")) or any(c.get("finish_reason") for c in chunk["choices"])


#: Cancels sent after a stream's reader went away (held until done: see :func:`chunks`).
_cancelling: set[asyncio.Task[bool]] = set()


async def chunks(
    conn: AsyncRedis, job_id: str, first: list[dict[str, Any]], last_id: str, ttl: int
) -> AsyncIterator[dict[str, Any]]:
    """The job's chunks: those read so far, then the rest as the worker writes them, up to
    the last one (an error chunk is the last one too). A reader that goes away before the
    last one (the client disconnected: the relay is cancelled or closed) cancels the job,
    from a task of its own (the relay's await would be cancelled at once)."""
    key = keys.stream_key(job_id)
    batch, ended = first, False
    try:
        while True:
            for chunk in batch:
                yield chunk
                if is_last(chunk):
                    ended = True
                    return
            reply = await conn.xread({key: last_id}, block=WAIT_S * 1000, count=500)
            batch = []
            for _, entries in reply or []:
                for entry_id, fields in entries:
                    last_id = entry_id.decode()
                    batch.append(json.loads(fields[b"chunk"]))
            if not reply and await conn.exists(keys.result_key(job_id)):
                ended = True
                return  # the job ended and wrote no more chunks
    finally:
        if not ended:
            task = asyncio.get_running_loop().create_task(cancel(conn, job_id, ttl))
            _cancelling.add(task)
            task.add_done_callback(_cancelling.discard)


async def relay(
    conn: AsyncRedis, job_id: str, first: list[dict[str, Any]], last_id: str, ttl: int
) -> AsyncIterator[bytes]:
    """Server-sent events: the chunks so far, then the rest as the worker writes them."""
    async for chunk in chunks(conn, job_id, first, last_id, ttl):
        if chunk.get("error"):
            yield f"data: {json.dumps({'error': chunk['error']})}\n\n".encode()
        else:
            yield f"data: {json.dumps(chunk)}\n\n".encode()
    yield b"data: [DONE]\n\n"


class Translation(Protocol):
    """A streamed chat job's chunks as another API's events (``responses``, ``messages``)."""

    def start(self) -> list[bytes]: ...

    def chunk(self, chunk: dict[str, Any]) -> list[bytes]: ...

    def failed(self, error: dict[str, Any], status: int = 500) -> list[bytes]: ...


async def translated(
    conn: AsyncRedis,
    job_id: str,
    stream: Translation,
    chunks: AsyncIterator[dict[str, Any]],
    finish: Callable[[dict[str, Any]], Awaitable[list[bytes]]],
) -> AsyncIterator[bytes]:
    """``stream``'s events for a streamed chat job: its start, its ``chunks`` as they
    come, then ``finish(completion)``'s events from the job's record (or a failure)."""
    for e in stream.start():
        yield e
    async for chunk in chunks:
        if chunk.get("error"):
            for e in stream.failed(chunk["error"]):
                yield e
            return
        for e in stream.chunk(chunk):
            yield e
    raw = await conn.get(keys.result_key(job_id))
    record = json.loads(raw) if raw else None
    if not record or record.get("status") != "succeeded":
        error = (record or {}).get("error") or {"code": "server_error", "message": "no result"}
        for e in stream.failed(error, int((record or {}).get("status_code") or 500)):
            yield e
        return
    for e in await finish(record["response"]):
        yield e
