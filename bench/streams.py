"""Streamed chat completions sent at once through the gateway: first chunk and last.

``--requests`` (16) streamed chat completions of ``--tokens`` (32) greedy tokens are sent
at once through the gateway (the OpenAI SDK, ``stream=True``) to one in-process worker
(``--max-batch auto``, the default queues) on the 12x1024 bench target ("wide"): each
request's seconds to its first content chunk and to its last, over ``--rounds`` rounds;
the texts must equal the same requests unstreamed (sent once before the clock starts).
``PYTHONPATH`` picks the worker's code, so the commit before streamed jobs shared batches
(each ran alone, one after another) runs the same script::

    .venv/bin/python -m bench.streams [--requests 16] [--tokens 32] [--rounds 2]
    PYTHONPATH=<older checkout> .venv/bin/python bench/streams.py
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

import openai
from redis import Redis

if not __package__:  # run as a script: not from bench/ (its worker.py is no ``worker``)
    sys.path[0:1] = []
    sys.path.append(str(Path(__file__).resolve().parents[1]))  # (PYTHONPATH goes first)

from bench.fixtures import model
from bench.gateway import KEY, start_gateway
from producer.localredis import LocalRedis
from schemas import keys
from worker.engine.models import ModelCache
from worker.runner.loop import Worker
from worker.runner.runtime import WorkerRuntime
from worker.schedule.policy import SpeculationPolicy

OUT = Path(__file__).parent / "out"
QUEUES = [keys.INTERACTIVE_QUEUE, keys.DEFAULT_QUEUE]


def ask(client: openai.OpenAI, target: str, i: int, tokens: int, stream: bool) -> dict:
    """One chat completion: its text, seconds to the first content chunk and to the end."""
    body = {"role": "user", "content": f"streamed question {i} about queues and workers"}
    start = time.perf_counter()
    if not stream:
        reply = client.chat.completions.create(
            model=target, messages=[body], max_tokens=tokens, temperature=0
        )
        return {"text": reply.choices[0].message.content or ""}
    first, text = None, []
    for chunk in client.chat.completions.create(
        model=target, messages=[body], max_tokens=tokens, temperature=0, stream=True
    ):
        piece = chunk.choices[0].delta.content if chunk.choices else None
        if piece:
            first = first if first is not None else time.perf_counter() - start
            text.append(piece)
    return {"text": "".join(text), "first_s": first, "last_s": time.perf_counter() - start}


def at_once(base: str, target: str, n: int, tokens: int, stream: bool) -> list[dict]:
    client = openai.OpenAI(base_url=base, api_key=KEY, max_retries=0, timeout=900)
    out: list[dict] = [{}] * n
    threads = [
        threading.Thread(
            target=lambda i=i: out.__setitem__(i, ask(client, target, i, tokens, stream))
        )
        for i in range(n)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def serve(url: str, rt: WorkerRuntime, stop: threading.Event) -> None:
    def loop() -> None:
        conn = Redis.from_url(url)
        while not stop.is_set():
            Worker(
                conn, QUEUES, rt, name=f"bench{time.monotonic_ns()}", max_batch=None, burst=True
            ).work()
            time.sleep(0.02)

    threading.Thread(target=loop, daemon=True).start()


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, round(q * (len(values) - 1)))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--target", default=None)
    args = ap.parse_args()
    target = args.target or model("wide")
    rt = WorkerRuntime(cache=ModelCache(), policy=SpeculationPolicy("never"))
    report: dict = {"args": vars(args) | {"target": target}, "rounds": []}
    with LocalRedis() as server:
        gateway, base = start_gateway(server.url, 1)
        stop = threading.Event()
        serve(server.url, rt, stop)
        try:
            plain = [r["text"] for r in at_once(base, target, args.requests, args.tokens, False)]
            for _ in range(args.rounds):
                t0 = time.perf_counter()
                got = at_once(base, target, args.requests, args.tokens, True)
                wall = time.perf_counter() - t0
                same = sum(g["text"] == p for g, p in zip(got, plain, strict=True))
                firsts = [g["first_s"] for g in got if g["first_s"] is not None]
                lasts = [g["last_s"] for g in got]
                row = {
                    "wall_s": round(wall, 2),
                    "first_p50_s": round(pct(firsts, 0.5), 2),
                    "first_p99_s": round(pct(firsts, 0.99), 2),
                    "last_p50_s": round(pct(lasts, 0.5), 2),
                    "last_p99_s": round(pct(lasts, 0.99), 2),
                    "tok_s": round(args.requests * args.tokens / wall, 1),
                    "texts_equal": f"{same}/{args.requests}",
                }
                report["rounds"].append(row)
                print(json.dumps(row), flush=True)
        finally:
            stop.set()
            gateway.terminate()
    medians = {
        k: statistics.median(r[k] for r in report["rounds"])
        for k in ("wall_s", "first_p50_s", "first_p99_s", "last_p99_s", "tok_s")
    }
    report["median"] = medians
    print("median", json.dumps(medians))
    OUT.mkdir(exist_ok=True)
    (OUT / "streams.json").write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
