"""``mlx_lm.server``, the peer mlxq is measured against: start it, send it requests.

The server runs as a subprocess of the same Python (same mlx and mlx-lm), with
its defaults; requests go to ``/v1/chat/completions`` from one thread each.
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(port: int, body: dict, attempts: int = 30) -> dict:
    """POST a chat completion; connection errors are retried, as a client would (the
    server's HTTP listener resets connections beyond its small backlog)."""
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    for attempt in range(attempts):
        try:
            with urllib.request.urlopen(req, timeout=1800) as r:
                return json.loads(r.read())
        except (ConnectionError, http.client.RemoteDisconnected, urllib.error.URLError):
            if attempt == attempts - 1:
                raise
            time.sleep(min(0.05 * 2**attempt, 1.0))
    raise AssertionError("unreachable")


@contextmanager
def mlx_lm_server(model: str, *extra: str) -> Iterator[int]:
    """``mlx_lm.server --model MODEL`` (its defaults, plus ``extra`` flags) on a free
    port, answered a first request; yields the port."""
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "mlx_lm.server", "--model", model, "--port", str(port), *extra],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=os.environ,
    )
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                post(port, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
                break
            except OSError:
                if time.monotonic() > deadline or server.poll() is not None:
                    raise SystemExit("mlx_lm.server did not start") from None
                time.sleep(0.5)
        yield port
    finally:
        server.terminate()
        server.wait(30)


def send_all(port: int, bodies: list[dict]) -> tuple[list[dict], float]:
    """Send every body at once (one thread each, ``model`` left out: the server has
    one); the replies in order and the seconds until the last one."""
    payloads = [{k: v for k, v in b.items() if k != "model"} for b in bodies]
    start = time.perf_counter()
    with ThreadPoolExecutor(len(payloads)) as pool:
        replies = list(pool.map(lambda b: post(port, b), payloads))
    return replies, time.perf_counter() - start
