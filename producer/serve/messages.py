"""Anthropic's Messages API on the gateway: a message is a chat job plus a translation.

``POST /v1/messages`` translates the body into a chat.completions body
(``schemas.anthropic``), runs it as a chat job on the interactive queue like
``/v1/chat/completions``, and translates the record back into a ``message``. With
``"stream": true`` the chat job's chunks are relayed as Anthropic's events:
``message_start``, per content block (``thinking``, ``text``, ``tool_use``)
``content_block_start`` / ``content_block_delta`` (``thinking_delta``, ``text_delta``,
``input_json_delta``) / ``content_block_stop``, then ``message_delta`` (stop reason and
usage, read from the job's record) and ``message_stop``; ``ping`` after the start; an
``error`` event if the job fails mid-way. Errors have Anthropic's shape
(``{"type": "error", "error": {"type", "message"}}``) and status codes.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import JSONResponse, Response, StreamingResponse
from redis.asyncio import Redis as AsyncRedis

from producer.serve.chat import translated
from schemas.anthropic import MessagesRequest, error_body, from_chat, new_id, usage


def error(status: int, message: str) -> JSONResponse:
    """An Anthropic error response."""
    return JSONResponse(error_body(status, message), status_code=status)


def reshaped(reply: Response) -> Response:
    """``reply`` with an OpenAI-shaped error body (the chat path's) in Anthropic's shape;
    any other reply as it is."""
    if reply.status_code < 400 or isinstance(reply, StreamingResponse):
        return reply
    try:
        body = json.loads(bytes(reply.body))
        message = body["error"]["message"]
    except (ValueError, KeyError, TypeError, AttributeError):
        return reply
    out = error(reply.status_code, message)
    for name in ("retry-after", "x-mlxq-job-id"):
        if name in reply.headers:
            out.headers[name] = reply.headers[name]
    return out


def _event(kind: str, **fields: Any) -> bytes:
    data = json.dumps({"type": kind, **fields}, separators=(",", ":"))
    return f"event: {kind}\ndata: {data}\n\n".encode()


class EventStream:
    """Turns a chat job's chunks into Anthropic's stream events."""

    def __init__(self, model: str, message_id: str) -> None:
        self.model, self.id = model, message_id
        self.open: str | None = None  # the type of the content block streamed now
        self.index = -1  # its index
        self.calls: dict[int, int] = {}  # a chunk's tool call index -> its block's index

    def start(self) -> list[bytes]:
        shell = {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": usage({}),
        }
        return [_event("message_start", message=shell), _event("ping")]

    def _block(self, kind: str, block: dict[str, Any]) -> list[bytes]:
        """Close the block streamed now (if any) and open a new one of ``kind``."""
        out = self._close()
        self.index += 1
        self.open = kind
        out.append(_event("content_block_start", index=self.index, content_block=block))
        return out

    def _close(self) -> list[bytes]:
        if self.open is None:
            return []
        out = []
        if self.open == "thinking":  # (a signature the client may send back: none here)
            delta = {"type": "signature_delta", "signature": ""}
            out.append(_event("content_block_delta", index=self.index, delta=delta))
        out.append(_event("content_block_stop", index=self.index))
        self.open = None
        return out

    def _delta(self, delta: dict[str, Any]) -> bytes:
        return _event("content_block_delta", index=self.index, delta=delta)

    def chunk(self, chunk: dict[str, Any]) -> list[bytes]:
        out: list[bytes] = []
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            if text := delta.get("reasoning_content"):
                if self.open != "thinking":
                    out += self._block("thinking", {"type": "thinking", "thinking": ""})
                out.append(self._delta({"type": "thinking_delta", "thinking": text}))
            if text := delta.get("content"):
                if self.open != "text":
                    out += self._block("text", {"type": "text", "text": ""})
                out.append(self._delta({"type": "text_delta", "text": text}))
            for call in delta.get("tool_calls") or []:
                out += self._call(call)
        return out

    def _call(self, call: dict[str, Any]) -> list[bytes]:
        out: list[bytes] = []
        fn = call.get("function") or {}
        if call.get("index", 0) not in self.calls:
            block = {"type": "tool_use", "id": call.get("id"), "name": fn.get("name"), "input": {}}
            out += self._block("tool_use", block)
            self.calls[call.get("index", 0)] = self.index
        if arguments := fn.get("arguments"):
            out.append(self._delta({"type": "input_json_delta", "partial_json": arguments}))
        return out

    def finish(self, message: dict[str, Any]) -> list[bytes]:
        delta = {"stop_reason": message["stop_reason"], "stop_sequence": message["stop_sequence"]}
        return [
            *self._close(),
            _event("message_delta", delta=delta, usage=message["usage"]),
            _event("message_stop"),
        ]

    def failed(self, error: dict[str, Any], status: int = 500) -> list[bytes]:
        return [
            b"event: error\ndata: "
            + json.dumps(error_body(status, error.get("message", "failed"))).encode()
            + b"\n\n"
        ]


class Shape:
    """How the gateway answers a Messages request from its chat job (``app._answer``)."""

    def __init__(self, req: MessagesRequest) -> None:
        self.req, self.id = req, new_id("msg")

    async def answer(self, completion: dict[str, Any]) -> dict[str, Any]:
        return from_chat(completion, self.req.model, self.id)

    def events(
        self, conn: AsyncRedis, job_id: str, chunks: AsyncIterator[dict[str, Any]]
    ) -> AsyncIterator[bytes]:
        stream = EventStream(self.req.model, self.id)

        async def finish(completion: dict[str, Any]) -> list[bytes]:
            return stream.finish(from_chat(completion, self.req.model, self.id))

        return translated(conn, job_id, stream, chunks, finish)


class Count:
    """How the gateway answers ``count_tokens`` from its one-token chat job."""

    async def answer(self, completion: dict[str, Any]) -> dict[str, Any]:
        return {"input_tokens": (completion.get("usage") or {}).get("prompt_tokens", 0)}

    def events(
        self, conn: AsyncRedis, job_id: str, chunks: AsyncIterator[dict[str, Any]]
    ) -> AsyncIterator[bytes]:
        raise NotImplementedError("count_tokens is never streamed")
