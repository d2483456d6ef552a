"""Following a streaming job's ``chat.completion.chunk`` objects as the worker writes them."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

from redis import Redis

from schemas import keys
from schemas.store import has_result


def iter_chunks(
    conn: Redis, job_id: str, *, timeout: float | None = None, block_ms: int = 1000
) -> Iterator[dict[str, Any]]:
    """Yield the job's chunks in order until its final chunk (finish_reason or error).

    Waits for the job to start; raises TimeoutError after ``timeout`` seconds
    without the final chunk. A job that ended without streaming (no
    ``stream: true``, or its stream expired) ends the iteration.
    """
    key = keys.stream_key(job_id)
    last = "0-0"
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        reply = conn.xread({key: last}, block=block_ms, count=500)
        for _, entries in reply or []:
            for entry_id, fields in entries:
                last = entry_id.decode()
                chunk = json.loads(fields[b"chunk"])
                yield chunk
                if chunk.get("error") or any(c.get("finish_reason") for c in chunk["choices"]):
                    return
        if not reply and has_result(conn, job_id) and not conn.exists(key):
            return
        if deadline is not None and time.monotonic() > deadline:
            raise TimeoutError(f"job {job_id}: stream not finished after {timeout}s")


def chunk_text(chunk: dict[str, Any]) -> str:
    """The content delta a chunk carries ('' for role, final and error chunks)."""
    return "".join(c.get("delta", {}).get("content") or "" for c in chunk.get("choices", []))
