"""Legacy ``/v1/completions`` on the gateway: a chat job with ``raw_prompt`` (no chat
template), its chat.completion and stream chunks translated to ``text_completion``."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from redis.asyncio import Redis as AsyncRedis

from schemas.completions import chunk_from_chat, from_chat


class Shape:
    """How the gateway answers a completions request from its chat job (``app._answer``)."""

    async def answer(self, completion: dict[str, Any]) -> dict[str, Any]:
        return from_chat(completion)

    async def events(
        self, conn: AsyncRedis, job_id: str, chunks: AsyncIterator[dict[str, Any]]
    ) -> AsyncIterator[bytes]:
        async for chunk in chunks:
            if chunk.get("error"):
                yield f"data: {json.dumps({'error': chunk['error']})}\n\n".encode()
                break
            yield f"data: {json.dumps(chunk_from_chat(chunk))}\n\n".encode()
        yield b"data: [DONE]\n\n"
