"""Anthropic's ``/v1/messages`` vs ``/v1/chat/completions``: the gateway's cost of the translation.

One gateway process and a stand-in worker (the real job lifecycle, ending each job at once
with a fixed 64-token answer: ``bench.gateway.stand_in``) on a private redis-server. The same
requests go to both routes, alternating route by request, from ``--clients`` keep-alive raw
HTTP connections (request bytes made ahead: no SDK CPU). A request's latency is from its
bytes leaving to its whole answer read: HTTP, validation, the translation both ways,
enqueueing, the stand-in's take and end, the notice. Printed: p50 / p99 per route and
their ratio, for 1 client and for ``--clients``.

Run:  .venv/bin/python -m bench.messages [--requests 2000] [--clients 16]
"""

from __future__ import annotations

import argparse
import http.client
import json
import statistics
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

from bench.gateway import KEY, stand_in, start_gateway
from producer.localredis import LocalRedis

OUT = Path(__file__).parent / "out"
MODEL = "bench-model"
ROUTES = {
    "chat": (
        "/v1/chat/completions",
        lambda i: {
            "model": MODEL,
            "max_tokens": 64,
            "messages": [
                {"role": "system", "content": "be brief"},
                {"role": "user", "content": f"request {i}: tell me about queues"},
            ],
        },
    ),
    "messages": (
        "/v1/messages",
        lambda i: {
            "model": MODEL,
            "max_tokens": 64,
            "system": "be brief",
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "text", "text": f"request {i}: tell me about queues"}],
                }
            ],
        },
    ),
}


def client(base: str, count: int, offset: int, out: dict[str, list[float]]) -> None:
    """``count`` requests on one keep-alive connection, the routes taking turns."""
    url = urlsplit(base)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=60)
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"}
    names = list(ROUTES)
    made = []
    for i in range(count):
        name = names[(i + offset) % 2]
        path, body = ROUTES[name]
        made.append((name, path, json.dumps(body(i)).encode()))
    for name, path, data in made:
        start = time.perf_counter()
        conn.request("POST", path, data, headers)
        reply = conn.getresponse()
        body = reply.read()
        seconds = time.perf_counter() - start
        if reply.status != 200:
            raise SystemExit(f"{path}: {reply.status} {body[:200]!r}")
        out[name].append(seconds)
    conn.close()


def run(base: str, requests: int, clients: int) -> dict[str, dict[str, float]]:
    out: dict[str, list[float]] = {name: [] for name in ROUTES}
    threads = [
        threading.Thread(target=client, args=(base, requests // clients, c, out))
        for c in range(clients)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stats = {}
    for name, values in out.items():
        values.sort()
        stats[name] = {
            "requests": len(values),
            "p50_ms": round(statistics.median(values) * 1000, 2),
            "p99_ms": round(values[min(len(values) - 1, int(0.99 * len(values)))] * 1000, 2),
        }
    for q in ("p50_ms", "p99_ms"):
        stats[f"messages_over_chat_{q[:3]}"] = round(stats["messages"][q] / stats["chat"][q], 3)
    return stats


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--clients", type=int, default=16)
    args = ap.parse_args()
    report: dict = {"args": vars(args)}
    with LocalRedis() as server:
        stop = threading.Event()
        worker = threading.Thread(target=stand_in, args=(server.url, stop), daemon=True)
        worker.start()
        gateway, base = start_gateway(server.url, 1)
        try:
            run(base.removesuffix("/v1"), 200, 4)  # warm up
            for clients in (1, args.clients):
                report[f"clients_{clients}"] = got = run(
                    base.removesuffix("/v1"), args.requests, clients
                )
                print(f"{clients} client(s):", json.dumps(got), flush=True)
        finally:
            gateway.terminate()
            gateway.wait()
            stop.set()
            worker.join()
    OUT.mkdir(exist_ok=True)
    (OUT / "messages.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
