"""Chat completions through the queue: enqueue one job, wait for its record or relay its stream.

A chat completion is an mlxq batch of one job (``chat_<hex>``) on the interactive
queue. The gateway waits on the batch's done list (``BLPOP``, one second at a
time, so a client that went away is noticed): a client that disconnects before
its job started cancels it (the batch flag: the worker drops it). With
``"stream": true`` the job writes ``chat.completion.chunk`` objects to its Redis
stream and the gateway relays them as server-sent events, ending with
``data: [DONE]``; until the first chunk arrives nothing is sent, so a job that
fails before generating (unknown model, say) still gets its HTTP status.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import AsyncIterator
from typing import Any

from redis import Redis
from redis.asyncio import Redis as AsyncRedis
from starlette.requests import Request

from producer.serve.settings import GatewaySettings
from producer.submit import SubmitItem, submit_items
from schemas import ChatRequest, ResultRecord, keys
from schemas.cancel import CANCELLED_AT

#: Longest single blocking read (seconds): how often a gone client is noticed.
WAIT_S = 1


def enqueue(conn: Redis, request: ChatRequest, body: dict[str, Any], s: GatewaySettings) -> str:
    """Enqueue the request as a batch of one on the interactive queue; its job id."""
    summary = submit_items(
        conn,
        [SubmitItem("chat", request, body)],
        batch_id=f"chat_{secrets.token_hex(10)}",
        queue=s.interactive_queue,
        job_timeout=s.job_timeout,
        result_ttl=s.chat_ttl,
        source="gateway",
    )
    return summary.job_ids[0]


async def cancel_if_unstarted(conn: AsyncRedis, job_id: str) -> bool:
    """Cancel a job nobody is waiting for any more, unless it has started (then it runs on:
    its record is kept for its TTL)."""
    if await conn.hexists(keys.RUNNING, job_id) or await conn.exists(keys.result_key(job_id)):
        return False
    await conn.hsetnx(keys.batch_key(keys.batch_of(job_id)), CANCELLED_AT, "0")
    return True


async def wait_record(
    conn: AsyncRedis, job_id: str, request: Request, timeout_s: float
) -> ResultRecord | None:
    """The job's record, or None if the client went away or ``timeout_s`` passed (the job
    is then cancelled if it has not started)."""
    done = keys.batch_done_key(keys.batch_of(job_id))
    waited = 0.0
    while True:
        raw = await conn.get(keys.result_key(job_id))
        if raw is not None:
            return ResultRecord.model_validate_json(raw)
        if waited >= timeout_s or await request.is_disconnected():
            await cancel_if_unstarted(conn, job_id)
            return None
        await conn.blpop([done], timeout=WAIT_S)
        waited += WAIT_S


async def first_chunks(
    conn: AsyncRedis, job_id: str, request: Request, timeout_s: float
) -> tuple[list[dict[str, Any]], str, ResultRecord | None]:
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
            return [], "", ResultRecord.model_validate_json(raw)
        waited += WAIT_S
        if waited >= timeout_s or await request.is_disconnected():
            await cancel_if_unstarted(conn, job_id)
            return [], "", None


def is_last(chunk: dict[str, Any]) -> bool:
    return bool(chunk.get("error")) or any(c.get("finish_reason") for c in chunk["choices"])


async def relay(
    conn: AsyncRedis, job_id: str, first: list[dict[str, Any]], last_id: str
) -> AsyncIterator[bytes]:
    """Server-sent events: the chunks so far, then the rest as the worker writes them."""
    key = keys.stream_key(job_id)
    chunks = first
    while True:
        for chunk in chunks:
            if chunk.get("error"):
                yield f"data: {json.dumps({'error': chunk['error']})}\n\n".encode()
            else:
                yield f"data: {json.dumps(chunk)}\n\n".encode()
            if is_last(chunk):
                yield b"data: [DONE]\n\n"
                return
        reply = await conn.xread({key: last_id}, block=WAIT_S * 1000, count=500)
        chunks = []
        for _, entries in reply or []:
            for entry_id, fields in entries:
                last_id = entry_id.decode()
                chunks.append(json.loads(fields[b"chunk"]))
        if not reply and await conn.exists(keys.result_key(job_id)):
            yield b"data: [DONE]\n\n"  # the job ended and wrote no more chunks
            return
