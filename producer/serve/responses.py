"""The Responses API on the gateway: a response is a chat job plus a translation.

``POST /v1/responses`` translates the request into a chat.completions body
(``schemas.responses``, with the messages of its ``previous_response_id`` chain),
runs it as a chat job on the interactive queue like ``/v1/chat/completions``, and
translates the record back. A stored response (``store``, the default) is kept at
``mlxq:response:<id>`` for the chat TTL with the conversation a later response
continues from; ``store: false`` keeps nothing. ``stream: true`` relays the chat job's
chunks as typed events: ``response.created``, ``response.in_progress``, per item
``response.output_item.added`` ... ``.done`` with the text and reasoning deltas in
between, then ``response.completed`` (or ``response.incomplete``/``response.failed``).
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from redis.asyncio import Redis as AsyncRedis

from producer.serve.chat import translated
from schemas import keys
from schemas.responses import (
    ResponsesRequest,
    conversation,
    from_chat,
    new_id,
)


async def _read(conn: AsyncRedis, response_id: str, part: str, scope: str | None) -> Any:
    """A part of a stored response that ``scope`` may read (None: no such response, or
    another tenant's, alike)."""
    raw = await conn.get(keys.response_key(response_id))
    if raw is None:
        return None
    value = json.loads(raw)
    if scope is not None and value.get("tenant", keys.DEFAULT_TENANT) != scope:
        return None
    return value[part]


async def history(
    conn: AsyncRedis, response_id: str, scope: str | None
) -> list[dict[str, Any]] | None:
    """The conversation a stored response ends (None: no such response, expired, or not
    ``scope``'s: a tenant, or None for every tenant's)."""
    return await _read(conn, response_id, "messages", scope)


async def stored(conn: AsyncRedis, response_id: str, scope: str | None) -> dict[str, Any] | None:
    """A stored response (None: no such response, expired, or not ``scope``'s)."""
    return await _read(conn, response_id, "response", scope)


async def delete(conn: AsyncRedis, response_id: str, scope: str | None) -> bool:
    """Delete a stored response ``scope`` may read; False if there is none."""
    if await stored(conn, response_id, scope) is None:
        return False
    return bool(await conn.delete(keys.response_key(response_id)))


async def keep(
    conn: AsyncRedis,
    req: ResponsesRequest,
    response: dict[str, Any],
    body: dict[str, Any],
    completion: dict[str, Any],
    ttl: int,
    tenant: str = keys.DEFAULT_TENANT,
) -> None:
    """Store ``response`` and its conversation as ``tenant``'s (unless ``store: false``)."""
    if not req.store:
        return
    value = {"response": response, "messages": conversation(body, completion), "tenant": tenant}
    await conn.set(keys.response_key(response["id"]), json.dumps(value), ex=ttl)


def _event(kind: str, seq: int, **fields: Any) -> bytes:
    data = json.dumps({"type": kind, "sequence_number": seq, **fields}, separators=(",", ":"))
    return f"event: {kind}\ndata: {data}\n\n".encode()


class EventStream:
    """Turns a chat job's chunks into Responses events (the final response from its record)."""

    def __init__(self, req: ResponsesRequest, response_id: str, created: int) -> None:
        self.req, self.id, self.created = req, response_id, created
        self.seq = 0
        self.items: list[dict[str, Any]] = []  # streamed so far: reasoning and message
        self.texts: list[str] = []

    def _next(self, kind: str, **fields: Any) -> bytes:
        self.seq += 1
        return _event(kind, self.seq - 1, **fields)

    def start(self) -> list[bytes]:
        shell = from_chat(_EMPTY, self.req, self.id, self.created) | {
            "status": "in_progress",
            "output": [],
            "usage": None,
        }
        return [
            self._next("response.created", response=shell),
            self._next("response.in_progress", response=shell),
        ]

    def _item(self, kind: str) -> tuple[int, list[bytes]]:
        """The index of the streamed item of ``kind`` (opened now if it is new)."""
        if self.items and self.items[-1]["type"] == kind:
            return len(self.items) - 1, []
        out = self._close()
        index = len(self.items)
        if kind == "message":
            item = {"type": "message", "id": new_id("msg"), "status": "in_progress"}
            item |= {"role": "assistant", "content": []}
            part = {"type": "output_text", "text": "", "annotations": []}
        else:
            item = {"type": "reasoning", "id": new_id("rs"), "summary": [], "content": []}
            part = {"type": "reasoning_text", "text": ""}
        self.items.append(item)
        self.texts.append("")
        out.append(self._next("response.output_item.added", output_index=index, item=item))
        out.append(
            self._next(
                "response.content_part.added",
                item_id=item["id"],
                output_index=index,
                content_index=0,
                part=part,
            )
        )
        return index, out

    def _close(self) -> list[bytes]:
        """End the item streamed last (its text done, its part and itself done)."""
        if not self.items or self.items[-1].get("_done"):
            return []
        index, item = len(self.items) - 1, self.items[-1]
        item["_done"] = True
        text = self.texts[index]
        message = item["type"] == "message"
        part = (
            {"type": "output_text", "text": text, "annotations": []}
            if message
            else {"type": "reasoning_text", "text": text}
        )
        done = "response.output_text.done" if message else "response.reasoning_text.done"
        where = {"item_id": item["id"], "output_index": index, "content_index": 0}
        final = {k: v for k, v in item.items() if k != "_done"}
        final["content"] = [part]
        if message:
            final["status"] = "completed"
        return [
            self._next(done, text=text, **where),
            self._next("response.content_part.done", part=part, **where),
            self._next("response.output_item.done", output_index=index, item=final),
        ]

    def chunk(self, chunk: dict[str, Any]) -> list[bytes]:
        out: list[bytes] = []
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            for field, kind in (("reasoning_content", "reasoning"), ("content", "message")):
                text = delta.get(field)
                if not text:
                    continue
                index, opened = self._item(kind)
                out += opened
                self.texts[index] += text
                name = (
                    "response.output_text.delta"
                    if kind == "message"
                    else ("response.reasoning_text.delta")
                )
                item_id = self.items[index]["id"]
                out.append(
                    self._next(
                        name, item_id=item_id, output_index=index, content_index=0, delta=text
                    )
                )
        return out

    def finish(self, response: dict[str, Any]) -> list[bytes]:
        """The events after the last chunk: items still open, the rest of the response's
        items (tool calls), and the final event."""
        out = self._close()
        streamed = {item["type"]: item["id"] for item in self.items}
        for item in response["output"]:  # the ids the client saw
            if item["type"] in streamed:
                item["id"] = streamed.pop(item["type"])
        for index, item in enumerate(response["output"][len(self.items) :], len(self.items)):
            out.append(self._next("response.output_item.added", output_index=index, item=item))
            if item["type"] == "function_call":
                out.append(
                    self._next(
                        "response.function_call_arguments.done",
                        item_id=item["id"],
                        output_index=index,
                        arguments=item["arguments"],
                    )
                )
            out.append(self._next("response.output_item.done", output_index=index, item=item))
        final = (
            "response.incomplete" if response["status"] == "incomplete" else "response.completed"
        )
        out.append(self._next(final, response=response))
        return out

    def failed(self, error: dict[str, Any], status: int = 500) -> list[bytes]:
        shell = from_chat(_EMPTY, self.req, self.id, self.created)
        shell |= {"status": "failed", "output": [], "usage": None, "error": error}
        return [self._next("response.failed", response=shell)]


#: A chat completion with nothing in it (the shell of a response under way).
_EMPTY: dict[str, Any] = {"choices": [{"message": {}, "finish_reason": "stop"}], "usage": {}}


class Shape:
    """How the gateway answers a Responses request from its chat job (``app._answer``)."""

    def __init__(
        self,
        req: ResponsesRequest,
        chat_body: dict[str, Any],
        conn: AsyncRedis,
        ttl: int,
        tenant: str = keys.DEFAULT_TENANT,
    ) -> None:
        self.req, self.chat_body, self.conn, self.ttl = req, chat_body, conn, ttl
        self.tenant = tenant  # whose the stored response is
        self.id, self.created = new_id("resp"), int(time.time())

    async def answer(self, completion: dict[str, Any]) -> dict[str, Any]:
        """The response for the job's chat.completion (stored unless ``store: false``)."""
        response = from_chat(completion, self.req, self.id, self.created)
        await self.keep(response, completion)
        return response

    async def keep(self, response: dict[str, Any], completion: dict[str, Any]) -> None:
        await keep(self.conn, self.req, response, self.chat_body, completion, self.ttl, self.tenant)

    def events(
        self, conn: AsyncRedis, job_id: str, chunks: AsyncIterator[dict[str, Any]]
    ) -> AsyncIterator[bytes]:
        stream = EventStream(self.req, self.id, self.created)
        return events(conn, job_id, stream, chunks, self.keep)


def events(
    conn: AsyncRedis,
    job_id: str,
    stream: EventStream,
    chunks: AsyncIterator[dict[str, Any]],
    on_done: Callable[[dict[str, Any], dict[str, Any]], Awaitable[None]],
) -> AsyncIterator[bytes]:
    """The Responses events of a streamed chat job: ``chunks`` relayed as they come, then
    the response made from the job's record (``on_done(response, completion)`` stores it)."""

    async def finish(completion: dict[str, Any]) -> list[bytes]:
        response = from_chat(completion, stream.req, stream.id, stream.created)
        await on_done(response, completion)
        return stream.finish(response)

    return translated(conn, job_id, stream, chunks, finish)
