"""The gateway: overhead per request with a real worker, and requests/s with instant jobs.

1. ``--clients`` concurrent ``openai`` SDK clients (AsyncOpenAI, one event loop)
   send chat completions through ``producer serve`` to one real worker on the
   tiny benchmark model. Every request must be answered once. The gateway's
   overhead per request is the client's latency minus the job's own time from
   its record (queue wait and run: ``finished_at`` minus the envelope's
   ``submitted_at``), counted from when the job was in Redis (the gateway's
   Server-Timing ``job``: the record's time less the enqueue round trip, which
   a burst makes long): HTTP, validation, enqueueing, noticing the record and
   answering. p50 and p99: all requests, the first wave (all clients at once,
   on new connections) and the rest. Then the same requests from a light
   client (raw keep-alive HTTP, request bytes made ahead), which leaves out the
   SDK's own CPU (~1.3 ms a request on a fast core) and its event loop's queue.
   Last, the floor of the first wave: the same SDK wave to bench/instant_http (the
   same HTTP stack answering at once: no gateway, no Redis, no worker), and how far
   the gateway's first wave is above it (a difference of percentiles). The
   client process freezes its startup heap first: it imported mlx-lm to make the
   model, and a full collection over that heap stopped all 64 clients ~70 ms in
   the middle of the first wave.
2. Requests/s the gateway sustains when jobs take no time: a stand-in worker
   (the real job lifecycle, ending each job at once with a fixed answer) serves
   the interactive queue, with 1 and with 4 gateway processes (``producer serve
   --workers``), for ``--seconds`` each: first the same SDK clients (one
   process: its own CPU, ~1.3 ms a request, caps it), then a raw keep-alive
   HTTP load in two processes with the request bytes made once.

Run:  .venv/bin/python -m bench.gateway [--clients 64] [--requests 512]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from contextvars import ContextVar
from pathlib import Path

import openai
from redis import Redis

from bench.bigbatch import answer
from bench.fixtures import model
from producer.localredis import LocalRedis, free_port
from schemas import keys
from worker.lifecycle.held import Lifecycle

OUT = Path(__file__).parent / "out"
BIN = Path(sys.executable).parent
KEY = "sk-bench"
#: job id -> (wall clock when its bytes left the client, when the client had parsed the
#: answer, the gateway's Server-Timing (its own overhead; the worker's finished_at to the
#: record in its hands), when the answer's headers arrived)
STAMPS: dict[str, tuple[float, float, dict[str, float], float]] = {}


def start_gateway(url: str, processes: int) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    env = os.environ | {"MLXQ_API_KEYS": KEY, "MLXQ_REDIS_URL": url}
    proc = subprocess.Popen(
        [str(BIN / "producer"), "serve", "--port", str(port), "--workers", str(processes)],
        env=env,
        stderr=subprocess.DEVNULL,
    )
    base = f"http://127.0.0.1:{port}/v1"
    client = openai.OpenAI(base_url=base, api_key=KEY, max_retries=0)
    for _ in range(300):
        try:
            client.models.list()
            return proc, base
        except openai.APIConnectionError:
            time.sleep(0.1)
    raise SystemExit("the gateway did not start")


async def one(
    client: openai.AsyncOpenAI, target: str, i: int, vary: bool = False
) -> tuple[str, float]:
    """One chat completion: (job id, seconds from the SDK call to its parsed answer)."""
    sent: list[float] = []
    SENT.set(sent)
    start = time.perf_counter()
    raw = await client.chat.completions.with_raw_response.create(
        model=target,
        messages=[{"role": "user", "content": f"request {i}"}],
        max_tokens=4 + 4 * (i % 16) if vary else 8,
        temperature=0,
    )
    raw.parse()
    elapsed = time.perf_counter() - start
    timing = server_timing(raw.headers["server-timing"])
    STAMPS[raw.headers["x-mlxq-job-id"]] = (sent[0], time.time(), timing, sent[1])
    return raw.headers["x-mlxq-job-id"], elapsed


def server_timing(header: str) -> dict[str, float]:
    """``gateway;dur=1.2, notice;dur=0.8`` -> {"gateway": 1.2, "notice": 0.8}."""
    parts = (p.strip().split(";dur=") for p in header.split(","))
    return {name: float(dur) for name, dur in parts}


#: Set per request; the HTTP client's request hook notes when the bytes go out (the SDK
#: spends ~1 ms of CPU building each request before that, its own cost, not the gateway's).
SENT: ContextVar[list[float]] = ContextVar("sent")


async def _note_sent(_request: object) -> None:
    SENT.get().append(time.time())


async def _note_answered(_response: object) -> None:
    SENT.get().append(time.time())  # the answer's headers are in, before the SDK parses it


def sdk(base: str, timeout: float) -> openai.AsyncOpenAI:
    hooks = {"request": [_note_sent], "response": [_note_answered]}
    http = openai.DefaultAsyncHttpxClient(event_hooks=hooks)
    return openai.AsyncOpenAI(
        base_url=base, api_key=KEY, max_retries=0, timeout=timeout, http_client=http
    )


async def overhead(
    base: str, target: str, clients: int, requests: int, vary: bool = False
) -> list[tuple[str, float]]:
    client = sdk(base, 600)
    sem = asyncio.Semaphore(clients)

    async def bounded(i: int) -> tuple[str, float]:
        async with sem:
            return await one(client, target, i, vary)

    return await asyncio.gather(*(bounded(i) for i in range(requests)))


async def sustained(base: str, target: str, clients: int, seconds: float) -> int:
    client = sdk(base, 60)
    deadline, count = time.monotonic() + seconds, 0

    async def loop(c: int) -> None:
        nonlocal count
        i = 0
        while time.monotonic() < deadline:
            await one(client, target, c * 1_000_000 + i)
            count += 1
            i += 1

    await asyncio.gather(*(loop(c) for c in range(clients)))
    return count


def _http_request(base: str, body: dict[str, object]) -> tuple[str, int, bytes]:
    """(host, port, the bytes of a keep-alive chat completion request)."""
    host, port = base.split("//")[1].split("/")[0].split(":")
    data = json.dumps(body).encode()
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {KEY}"
        f"\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
    )
    return host, int(port), head.encode() + data


async def _exchange(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, request: bytes
) -> bytes:
    """Send one request, read its whole answer: the answer's headers."""
    writer.write(request)
    headers = await reader.readuntil(b"\r\n\r\n")
    assert headers.startswith(b"HTTP/1.1 200"), headers[:200]
    length = int(headers.lower().split(b"content-length:")[1].split(b"\r\n")[0])
    await reader.readexactly(length)
    return headers


async def raw_load(base: str, target: str, conns: int, seconds: float) -> int:
    """Chat completions over plain keep-alive HTTP/1.1 connections, the request bytes made
    once: a load generator light enough that the gateway, not the client, is measured."""
    body = {"model": target, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
    host, port, request = _http_request(base, body)
    deadline, count = time.monotonic() + seconds, 0

    async def conn() -> None:
        nonlocal count
        reader, writer = await asyncio.open_connection(host, port)
        while time.monotonic() < deadline:
            await _exchange(reader, writer, request)
            count += 1
        writer.close()

    await asyncio.gather(*(conn() for _ in range(conns)))
    return count


async def light(
    base: str, target: str, clients: int, requests: int, vary: bool
) -> list[tuple[str, float, dict[str, float]]]:
    """Part 1 again with a light client in place of the SDK: ``clients`` keep-alive
    connections, request bytes made ahead. (job id, seconds from its bytes out to its
    whole answer in)."""
    made = [
        _http_request(
            base,
            {
                "model": target,
                "messages": [{"role": "user", "content": f"request {i}"}],
                "max_tokens": 4 + 4 * (i % 16) if vary else 8,
                "temperature": 0,
            },
        )
        for i in range(requests)
    ]
    todo = list(reversed(list(enumerate(made))))
    out: dict[int, tuple[str, float, dict[str, float]]] = {}

    async def conn() -> None:
        reader, writer = await asyncio.open_connection(made[0][0], made[0][1])
        while todo:
            i, (_, _, request) = todo.pop()
            start = time.perf_counter()
            headers = await _exchange(reader, writer, request)
            elapsed = time.perf_counter() - start
            head = headers.decode().lower()
            job_id = head.split("x-mlxq-job-id:")[1].split("\r\n")[0].strip()
            timing = head.split("server-timing:")[1].split("\r\n")[0]
            out[i] = (job_id, elapsed, server_timing(timing))
        writer.close()

    await asyncio.gather(*(conn() for _ in range(clients)))
    return [out[i] for i in sorted(out)]  # in sending order: the first wave first


async def floor_wave(base: str, clients: int) -> list[tuple[float, float]]:
    """One wave of ``clients`` SDK chat completions at once, on new connections, to
    bench/instant_http: (seconds from the SDK call to its parsed answer, from its bytes
    out to the answer's headers in) each, what the SDK and HTTP cost with no gateway."""
    client = sdk(base, 60)

    async def call(i: int) -> tuple[float, float]:
        sent: list[float] = []
        SENT.set(sent)
        start = time.perf_counter()
        raw = await client.chat.completions.with_raw_response.create(
            model="instant",
            messages=[{"role": "user", "content": f"request {i}"}],
            max_tokens=8,
            temperature=0,
        )
        raw.parse()
        return time.perf_counter() - start, sent[1] - sent[0]

    return await asyncio.gather(*(call(i) for i in range(clients)))


def floor(clients: int) -> dict[str, float]:
    """The first wave's floor on this machine: the SDK wave against bench/instant_http."""
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "bench.instant_http", "--port", str(port)],
        cwd=Path(__file__).parent.parent,
        stderr=subprocess.DEVNULL,
    )
    try:
        for _ in range(300):
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.1)
        base = f"http://127.0.0.1:{port}/v1"
        asyncio.run(floor_wave(base, 4))  # warm, as the gateway is before its first wave
        rows = asyncio.run(floor_wave(base, clients))
    finally:
        server.terminate()
        server.wait(30)
    out: dict[str, float] = {"requests": len(rows)}
    for name, values in (("sdk", [r[0] for r in rows]), ("http_round_trip", [r[1] for r in rows])):
        out[f"{name}_p50_ms"] = round(percentile(values, 0.5) * 1000, 2)
        out[f"{name}_p99_ms"] = round(percentile(values, 0.99) * 1000, 2)
    return out


def _raw_load_process(base: str, target: str, conns: int, seconds: float) -> int:
    return asyncio.run(raw_load(base, target, conns, seconds))


def stand_in(url: str, stop: threading.Event) -> None:
    """Ends every interactive job at once with a fixed answer (the real lifecycle)."""
    life = Lifecycle(Redis.from_url(url), "stand-in", [keys.INTERACTIVE_QUEUE])
    life.register()
    while not stop.is_set():
        jobs = [job] if (job := life.take(block_s=0.2)) is not None else []
        while jobs and len(jobs) < 64 and (job := life.take()) is not None:
            jobs.append(job)  # whatever else is queued: ended in one round trip
        life.end_many([(j, answer(j.id, j.envelope.batch_id, j.envelope.custom_id)) for j in jobs])
    life.unregister()


def overhead_stats(conn: Redis, results: list[tuple[str, float]]) -> dict[str, float]:
    """Overhead percentiles (ms) of ``results``: as the SDK saw it (its own request
    building and answer parsing included), from when the request bytes left, from then
    to the answer's arrival (the HTTP round trip, no SDK CPU), inside the gateway; and
    the inbound and outbound parts, the outbound part split in the notice (the worker's
    finished_at to the record in the gateway's hands) and the answer (from there to the
    answer's headers at the client)."""
    seen, wire, http, gateway, inbound, outbound, own = [], [], [], [], [], [], []
    notice, answer, enqueue = [], [], []
    for job_id, latency in results:
        record = json.loads(conn.get(keys.result_key(job_id)))
        assert record["status"] == "succeeded", record
        sent, got, timing, answered = STAMPS[job_id]
        job = own_time(record, timing)
        own.append(job)
        seen.append((latency - job) * 1000)
        wire.append((got - sent - job) * 1000)
        http.append((answered - sent - job) * 1000)
        gateway.append(timing["gateway"])
        inbound.append((record["finished_at"] - job - sent) * 1000)
        outbound.append((got - record["finished_at"]) * 1000)
        notice.append(timing["notice"])
        enqueue.append(timing["enqueue"])
        answer.append((answered - record["finished_at"]) * 1000 - timing["notice"])
    out = {"requests": len(results), "job_time_p50_s": round(statistics.median(own), 3)}
    for name, values in (
        ("sdk", seen),
        ("from_sent", wire),
        ("http_round_trip", http),
        ("gateway_side", gateway),
        ("in", inbound),
        ("in_gateway", enqueue),
        ("out", outbound),
        ("out_notice", notice),
        ("out_answer", answer),
    ):
        out[f"{name}_p50_ms"] = round(percentile(values, 0.5), 2)
        out[f"{name}_p99_ms"] = round(percentile(values, 0.99), 2)
    return out


def own_time(record: dict[str, object], timing: dict[str, float]) -> float:
    """The job's own time (s): from when it was in Redis to its worker's finished_at, the
    gateway's Server-Timing ``job`` (its record's queue wait and run less the enqueue round
    trip, which the ``submitted_at`` stamp includes and a burst can make long); at most
    the record's own figure."""
    m = record["metrics"]
    assert isinstance(m, dict)
    return min(m["queue_wait_s"] + m["total_time_s"], timing["job"] / 1000)


def light_stats(
    conn: Redis, results: list[tuple[str, float, dict[str, float]]]
) -> dict[str, float]:
    """Overhead percentiles (ms) as the light client saw it (bytes out to answer in)."""
    values = []
    for job_id, latency, timing in results:
        record = json.loads(conn.get(keys.result_key(job_id)))
        assert record["status"] == "succeeded", record
        values.append((latency - own_time(record, timing)) * 1000)
    return {
        "requests": len(results),
        "p50_ms": round(percentile(values, 0.5), 2),
        "p99_ms": round(percentile(values, 0.99), 2),
    }


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--requests", type=int, default=512)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--gateways", type=int, default=1, help="gateway processes for part 1")
    ap.add_argument("--worker-threads", type=int, default=1, help="the worker's BLAS threads")
    ap.add_argument(
        "--worker-nice",
        type=int,
        default=0,
        help="run the worker at this niceness (19: the gateway and clients first, as when "
        "the model's work is on a GPU and the CPU is theirs)",
    )
    ap.add_argument(
        "--vary",
        action="store_true",
        help="max_tokens 4-64 by request (default: 8 for all, so a batch ends all at once)",
    )
    args = ap.parse_args()
    OUT.mkdir(exist_ok=True)
    target = model("medium")
    report: dict[str, object] = {
        "clients": args.clients,
        "requests": args.requests,
        "gateway_processes": args.gateways,
        "worker_blas_threads": args.worker_threads,
        "worker_nice": args.worker_nice,
        "max_tokens": "4-64 by request" if args.vary else 8,
    }
    with LocalRedis() as server:
        conn = Redis.from_url(server.url)
        gateway, base = start_gateway(server.url, args.gateways)
        # One BLAS thread: on a Mac the model runs on the GPU and leaves the CPU cores to the
        # gateway and the clients; on this CPU-only box a 2-thread worker would take both.
        worker = subprocess.Popen(
            [str(BIN / "worker"), "--redis-url", server.url, "--name", "bench", "--model", target],
            stderr=subprocess.DEVNULL,
            env=os.environ | {"OPENBLAS_NUM_THREADS": str(args.worker_threads)},
            preexec_fn=(lambda: os.nice(args.worker_nice)) if args.worker_nice else None,
        )
        # This process imported mlx-lm to make the model: a full collection over that heap
        # (~140k objects) stopped the clients for ~50-70 ms, mid-wave. Not the gateway's
        # cost, and a long-lived client would freeze its startup heap as the gateway does.
        gc.collect()
        gc.freeze()
        try:
            asyncio.run(overhead(base, target, 4, 8))  # the worker loads the model
            results = asyncio.run(overhead(base, target, args.clients, args.requests, args.vary))
            plain = asyncio.run(light(base, target, args.clients, args.requests, args.vary))
        finally:
            worker.terminate()
            worker.wait(60)
        for arm in (results, plain):
            ids = [row[0] for row in arm]
            assert len(set(ids)) == len(ids) == args.requests, "a request lost or duplicated"
        report["answered"] = len(results) + len(plain)
        # All requests, then the steady state: without the first wave of `clients`
        # requests, which all start in the same instant.
        waves = (("all", results), ("first_wave", results[: args.clients]))
        for label, part in (*waves, ("steady", results[args.clients :])):
            report[label] = overhead_stats(conn, part)
        # The light client: latency minus the job's own time, no SDK CPU on either side.
        for label, part in (
            ("light_all", plain),
            ("light_first_wave", plain[: args.clients]),
            ("light_steady", plain[args.clients :]),
        ):
            report[label] = light_stats(conn, part)
        gateway.terminate()
        gateway.wait(30)
        # The floor: the same first wave to an instant answer on the same HTTP stack.
        report["floor_first_wave"] = low = floor(args.clients)
        first = report["first_wave"]
        assert isinstance(first, dict)
        report["first_wave_sdk_beyond_floor_ms"] = {
            q: round(first[f"sdk_{q}_ms"] - low[f"sdk_{q}_ms"], 2) for q in ("p50", "p99")
        }
        for processes in (1, 4):
            stop = threading.Event()
            thread = threading.Thread(target=stand_in, args=(server.url, stop))
            thread.start()
            gateway, base = start_gateway(server.url, processes)
            try:
                count = asyncio.run(sustained(base, target, args.clients, args.seconds))
                with ProcessPoolExecutor(2) as pool:
                    per = args.clients // 2
                    runs = [
                        pool.submit(_raw_load_process, base, target, per, args.seconds)
                        for _ in range(2)
                    ]
                    raw = sum(r.result() for r in runs)
            finally:
                stop.set()
                thread.join(30)
                gateway.terminate()
                gateway.wait(30)
            report[f"instant_sdk_req_per_s_{processes}_process"] = round(count / args.seconds, 1)
            report[f"instant_raw_http_req_per_s_{processes}_process"] = round(raw / args.seconds, 1)
    (OUT / "gateway.json").write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
