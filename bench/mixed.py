"""One queue of mixed jobs: plain greedy ones, seeded sampling ones and ones with n choices.

What a Batch API file often holds: ``--plain`` (16) greedy jobs, ``--seeded`` (8) jobs
sampled at temperature 0.8 with a seed, and ``--choices`` (4) jobs asking for ``--n`` (4)
seeded choices, shuffled (seeded) into one queue, ``--tokens`` (32) tokens each (the end
tokens banned, so every arm decodes the same number), served by one in-process burst worker
(``--max-batch auto``) on the 12x1024 bench target ("wide"). Printed per round: the wall
time from submit to the last record, completion tokens per second, each kind's median and
last finish (seconds from submit), the largest ``batch_size``, and a digest of the greedy
texts (equal across rounds and checkouts). ``PYTHONPATH`` picks the worker's code, so the
commit before seeded and n jobs shared batches (each ran alone, between two turns of the
batch or after it) runs the same script::

    .venv/bin/python -m bench.mixed [--plain 16] [--seeded 8] [--choices 4] [--rounds 2]
    PYTHONPATH=<older checkout> .venv/bin/python bench/mixed.py
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import statistics
import sys
import time
from pathlib import Path

from redis import Redis

if not __package__:  # run as a script: not from bench/ (its worker.py is no ``worker``)
    sys.path[0:1] = []
    sys.path.append(str(Path(__file__).resolve().parents[1]))  # (PYTHONPATH goes first)

from bench.fixtures import model
from bench.serve import burst
from producer.localredis import LocalRedis
from worker.engine.models import ModelCache
from worker.runner.runtime import WorkerRuntime
from worker.schedule.policy import SpeculationPolicy

OUT = Path(__file__).parent / "out"


def bodies(target: str, args: argparse.Namespace, eos: list[int]) -> list[tuple[str, dict]]:
    """The queue's jobs, each with its kind, shuffled the same way every run."""
    kinds = ["plain"] * args.plain + ["seeded"] * args.seeded + ["choices"] * args.choices
    random.Random(0).shuffle(kinds)
    out = []
    for i, kind in enumerate(kinds):
        body = {
            "model": target,
            "messages": [{"role": "user", "content": f"mixed question {i} about queues"}],
            "max_tokens": args.tokens,
            "temperature": 0.0 if kind == "plain" else 0.8,
            "logit_bias": {str(t): -100 for t in eos},
        }
        if kind != "plain":
            body["seed"] = i
        if kind == "choices":
            body["n"] = args.n
        out.append((kind, body))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--plain", type=int, default=16)
    ap.add_argument("--seeded", type=int, default=8)
    ap.add_argument("--choices", type=int, default=4)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--target", default=None)
    args = ap.parse_args()
    target = args.target or model("wide")
    cache = ModelCache()
    entry, _ = cache.get(target)
    jobs = bodies(target, args, sorted(entry.tokenizer.eos_token_ids))
    report: dict = {"args": vars(args) | {"target": target}, "rounds": []}
    with LocalRedis() as server:
        conn = Redis.from_url(server.url)
        for r in range(args.rounds):
            rt = WorkerRuntime(cache=cache, worker_id=f"mixed-{r}", policy=SpeculationPolicy())
            start = time.time()
            records, wall = burst(conn, [b for _, b in jobs], rt, max_batch=None)
            tokens = sum(x.response.usage.completion_tokens for x in records if x.response)
            greedy = [
                x.response.choices[0].message.content or ""
                for (kind, _), x in zip(jobs, records, strict=True)
                if kind == "plain" and x.response
            ]
            row: dict = {
                "wall_s": round(wall, 2),
                "tok_s": round(tokens / wall, 1),
                "largest_batch": max(x.metrics.batch_size for x in records),
                "greedy_digest": hashlib.sha256("\0".join(greedy).encode()).hexdigest()[:12],
            }
            for kind in ("plain", "seeded", "choices"):
                done = [
                    x.finished_at - start
                    for (k, _), x in zip(jobs, records, strict=True)
                    if k == kind
                ]
                if done:
                    row[f"{kind}_p50_s"] = round(statistics.median(done), 2)
                    row[f"{kind}_last_s"] = round(max(done), 2)
            report["rounds"].append(row)
            print(json.dumps(row), flush=True)
    keys = [k for k in report["rounds"][0] if k.endswith("_s")]
    report["median"] = {k: statistics.median(r[k] for r in report["rounds"]) for k in keys}
    print("median", json.dumps(report["median"]))
    OUT.mkdir(exist_ok=True)
    (OUT / "mixed.json").write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
