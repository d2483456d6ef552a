"""Streaming partial output to apps: OpenAI ``chat.completion.chunk`` objects on a Redis stream."""

from __future__ import annotations

import json
import time
from typing import Any

from redis import Redis

from schemas import keys

#: Entries kept per job stream (XADD MAXLEN ~): plenty for one completion.
STREAM_MAXLEN = 20_000


class ChunkWriter:
    """Appends a job's chunks to ``mlxq:stream:<job_id>`` (field ``chunk``, JSON)."""

    def __init__(
        self,
        conn: Redis,
        job_id: str,
        completion_id: str,
        model: str,
        ttl: int,
    ) -> None:
        self.conn, self.key, self.ttl = conn, keys.stream_key(job_id), ttl
        self.base = {
            "id": completion_id,
            "object": "chat.completion.chunk",
            "created": int(time.time()),
            "model": model,
        }

    def _add(self, extra: dict[str, Any]) -> None:
        pipe = self.conn.pipeline(transaction=False)
        pipe.xadd(
            self.key,
            {"chunk": json.dumps(self.base | extra)},
            maxlen=STREAM_MAXLEN,
            approximate=True,
        )
        pipe.expire(self.key, self.ttl)
        pipe.execute()

    def start(self) -> None:
        """A fresh stream (a job re-run after a crash starts over) opened with the role."""
        self.conn.delete(self.key)
        self._choice({"role": "assistant", "content": ""})

    def text(
        self, delta: str, logprobs: dict[str, Any] | None = None, field: str = "content"
    ) -> None:
        """A piece of the text, with the logprobs (OpenAI's ``choices[].logprobs``, as
        JSON) of the tokens it completes when the job asked for them. ``field``:
        ``content``, or ``reasoning_content`` for a reasoning model's thinking."""
        self._choice({field: delta}, logprobs)

    def tool_call(self, index: int, call: dict[str, Any]) -> None:
        """A piece of the ``index``-th call (OpenAI's ``delta.tool_calls``): its first
        chunk carries ``id``, ``type`` and ``function.name``, the next ones fragments of
        ``function.arguments``."""
        self._choice({"tool_calls": [{"index": index} | call]})

    def finish(self, finish_reason: str, usage: dict[str, int]) -> None:
        self._add(
            {"choices": [{"index": 0, "delta": {}, "finish_reason": finish_reason}], "usage": usage}
        )

    def error(self, error: dict[str, Any]) -> None:
        self._add({"choices": [], "error": error})

    def _choice(self, delta: dict[str, Any], logprobs: dict[str, Any] | None = None) -> None:
        choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": None}
        if logprobs is not None:
            choice["logprobs"] = logprobs
        self._add({"choices": [choice]})
