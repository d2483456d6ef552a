"""Prefix reuse on any chat template: the real Gemma 3 270M with Gemma's own template,
which folds the system prompt into the first user turn (no message boundary to keep).

Three workloads of 32 greedy jobs (16 tokens each), each run twice in a row (round 1
cold, round 2 with whatever the arm kept from round 1):

- ``system700`` / ``system1500``: a shared ~700 / ~1,500-token system prompt and a short
  user message of its own;
- ``doc1500``: one user message that starts with a shared ~1,500-token document, then
  its own question (the RAG / extraction shape).

Arms: mlxq with its prefix cache (one in-process worker, ``--max-batch auto`` as
workers run by default, the same worker for both rounds), mlxq with
``--prefix-cache-gb 0`` (round 1 only: without a cache both rounds cost the same),
and ``mlx_lm.server`` (its prompt cache on, the same server for both rounds, 32
requests at once; its clients retry reset connections).
Prints jobs/s per round and the ratios; JSON in ``bench/out/autoprefix.json``.

    .venv/bin/python -m bench.autoprefix [--jobs 32] [--workloads system700,system1500,doc1500]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

from redis import Redis

from bench.peer import mlx_lm_server, send_all
from bench.prefix import WORDS, system_prompt
from bench.serve import burst
from producer.localredis import LocalRedis
from worker.engine.models import ModelCache
from worker.gguf.bundled import ensure
from worker.gguf.templates import GEMMA
from worker.runner import runtime

ROOT = Path(__file__).resolve().parents[1]
OUT = Path(__file__).parent / "out"
WORKLOADS = {"system700": ("system", 700), "system1500": ("system", 1500), "doc1500": ("doc", 1500)}


def gemma_with_template() -> str:
    """The imported Gemma 3 270M with Gemma's instruction template (what ``worker
    import-gguf --chat-template gemma`` writes), as a model directory of its own."""
    base = ensure(ROOT / ".mlxq" / "models").target
    out = base.parent / "gemma-3-270m-it-template"
    if not out.exists():
        shutil.copytree(base, out)
        config = json.loads((out / "tokenizer_config.json").read_text())
        config["chat_template"] = GEMMA
        (out / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    return str(out)


def bodies(target: str, shape: str, shared: str, n: int, max_tokens: int) -> list[dict]:
    def messages(i: int) -> list[dict]:
        item = f"Item {i}: the {WORDS[i % 12]} of job {i * 7}."
        if shape == "system":
            return [{"role": "system", "content": shared}, {"role": "user", "content": item}]
        return [{"role": "user", "content": f"{shared}\n\nQuestion about {item}"}]

    return [
        {"model": target, "temperature": 0, "max_tokens": max_tokens, "messages": messages(i)}
        for i in range(n)
    ]


def mlxq_rounds(
    conn: Redis, target: str, reqs: list[dict], prefix_gb: float, rounds: int, batch: int | None
):
    cache = ModelCache(prefix_bytes=int(prefix_gb * 1e9))
    cache.get(target)
    rt = runtime.WorkerRuntime(cache=cache, worker_id=f"bench-autoprefix-{prefix_gb}")
    warm = [{"model": target, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}]
    burst(conn, warm, rt, batch)
    out = []
    for _ in range(rounds):
        records, elapsed = burst(conn, reqs, rt, batch)
        cached = [r.response.usage.prompt_tokens_details.cached_tokens for r in records]
        out.append(
            {
                "jobs_per_s": len(records) / elapsed,
                "seconds": elapsed,
                "jobs_reusing": sum(1 for c in cached if c),
                "cached_tokens_max": max(cached),
                "prompt_tokens": records[0].response.usage.prompt_tokens,
                "texts": [r.response.choices[0].message.content for r in records],
            }
        )
    return out, cache.prefixes


def server_rounds(target: str, reqs: list[dict], rounds: int) -> list[dict]:
    out = []
    with mlx_lm_server(target) as port:
        for _ in range(rounds):
            replies, elapsed = send_all(port, reqs)
            out.append(
                {
                    "jobs_per_s": len(replies) / elapsed,
                    "seconds": elapsed,
                    "texts": [r["choices"][0]["message"]["content"] for r in replies],
                }
            )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--max-batch", type=int, default=None, help="[default: auto, as workers]")
    ap.add_argument("--arms", default="mlxq,no-cache,server")
    args = ap.parse_args()
    target = gemma_with_template()
    tokenizer = ModelCache().get(target)[0].tokenizer
    report: dict = {
        "target": target,
        "jobs": args.jobs,
        "max_tokens": args.max_tokens,
        "max_batch": args.max_batch or "auto",
    }
    with LocalRedis() as server:
        conn = Redis.from_url(server.url)
        for name in args.workloads.split(","):
            shape, size = WORKLOADS[name]
            reqs = bodies(target, shape, system_prompt(tokenizer, size), args.jobs, args.max_tokens)
            started = time.perf_counter()
            arms = args.arms.split(",")
            on, prefixes = mlxq_rounds(conn, target, reqs, 1.0, 2, args.max_batch)
            if "no-cache" not in arms or "server" not in arms:  # a quick look at mlxq alone
                print(name, [round(r["jobs_per_s"], 3) for r in on], file=sys.stderr)
                continue
            off, _ = mlxq_rounds(conn, target, reqs, 0.0, 1, args.max_batch)
            srv = server_rounds(target, reqs, 2)
            row = {
                "prompt_tokens": on[0]["prompt_tokens"],
                "shared_tokens_reused": on[1]["cached_tokens_max"],
                "jobs_per_s": {
                    "mlxq": [round(r["jobs_per_s"], 3) for r in on],
                    "mlxq_no_cache": round(off[0]["jobs_per_s"], 3),
                    "mlx_lm_server": [round(r["jobs_per_s"], 3) for r in srv],
                },
                "seconds": {
                    "mlxq": [round(r["seconds"], 1) for r in on],
                    "mlxq_no_cache": round(off[0]["seconds"], 1),
                    "mlx_lm_server": [round(r["seconds"], 1) for r in srv],
                },
                "mlxq_over_server": [
                    round(a["jobs_per_s"] / b["jobs_per_s"], 2)
                    for a, b in zip(on, srv, strict=True)
                ],
                "mlxq_over_no_cache": [
                    round(a["jobs_per_s"] / off[0]["jobs_per_s"], 2) for a in on
                ],
                "jobs_reusing": [r["jobs_reusing"] for r in on],
                "prefix_entries": len(prefixes),
                "prefix_mb": round(prefixes.nbytes / 1e6, 1),
                "texts_equal_cache_vs_no_cache": all(r["texts"] == off[0]["texts"] for r in on),
                "server_texts_equal_to_mlxq": sum(
                    a == b for a, b in zip(srv[0]["texts"], on[0]["texts"], strict=True)
                ),
                "wall_s": round(time.perf_counter() - started),
            }
            report[name] = row
            print(name, json.dumps(row), file=sys.stderr, flush=True)
    OUT.mkdir(exist_ok=True)
    (OUT / "autoprefix.json").write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
