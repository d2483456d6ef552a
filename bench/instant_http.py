"""A floor for bench/gateway: the same HTTP stack (uvicorn with httptools and uvloop)
answering every request at once with a fixed ``chat.completion``, no framework, no
Redis, no worker. What the SDK clients see against it is what any gateway on this
machine would cost them: their own CPU, TCP connects, HTTP both ways.

Run:  .venv/bin/python -m bench.instant_http --port 8001
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import uvicorn

ANSWER = json.dumps(
    {
        "id": "chatcmpl-instant",
        "object": "chat.completion",
        "created": 0,
        "model": "instant",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "An instant answer."},
                "finish_reason": "stop",
            }
        ],
        "usage": {"prompt_tokens": 8, "completion_tokens": 4, "total_tokens": 12},
    }
).encode()
HEADERS = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(ANSWER))]


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] != "http":
        return
    more = True
    while more:  # the whole body, as any server must read it
        message = await receive()
        more = message.get("more_body", False)
    await send({"type": "http.response.start", "status": 200, "headers": HEADERS})
    await send({"type": "http.response.body", "body": ANSWER})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--port", type=int, required=True)
    args = ap.parse_args()
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning", access_log=False)


if __name__ == "__main__":
    main()
