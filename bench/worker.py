"""Worker overhead: tokens/s through producer -> Redis -> worker -> result vs mlx-lm direct.

Same models, prompts and greedy settings on both sides, in one process, rounds
alternating so machine noise hits both alike; with and without a draft. Also
cold vs warm job latency. Run (OpenBLAS preloaded, see bench/run):

    .venv/bin/python -m bench.worker [--target PATH_OR_HUB_ID --draft ...] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm.generate import stream_generate
from mlx_lm.sample_utils import make_sampler
from redis import Redis

from bench.fixtures import bench_pair
from bench.plots import grouped_bars
from bench.serve import burst
from producer.localredis import LocalRedis
from schemas import ChatRequest
from worker.engine import prompt_tokens
from worker.engine.models import ModelCache
from worker.engine.request import prepare
from worker.engine.sequence import StopScan
from worker.runner import runtime
from worker.schedule.policy import SpeculationPolicy

OUT = Path(__file__).parent / "out"
TOPICS = ["queues", "caches", "drafts", "fleets", "tokens", "batches", "metrics", "restarts"]


def requests(target: str, draft: str | None, max_tokens: int) -> list[dict]:
    extra = {"draft_model": draft} if draft else {}
    return [
        {
            "model": target,
            "temperature": 0,
            "max_tokens": max_tokens,
            **extra,
            "messages": [{"role": "user", "content": f"Tell me about {t} and why they matter."}],
        }
        for t in TOPICS
    ]


def direct(cache: ModelCache, reqs: list[dict]) -> tuple[int, float, list[str]]:
    """Call mlx_lm.stream_generate directly: (tokens, seconds, texts)."""
    tokens, texts = 0, []
    start = time.perf_counter()
    for body in reqs:
        req = ChatRequest.model_validate(body)
        target, _ = cache.get(req.model)
        draft = cache.get(req.draft_model)[0].model if req.draft_model else None
        kwargs = {"draft_model": draft, "num_draft_tokens": 3} if draft is not None else {}
        # the stop strings the worker applies (a model without a chat template stops at
        # the transcript's next turn), cut here the same way, so both decode the same tokens
        stops = StopScan(prepare(req, target).params.stop)
        text = ""
        for r in stream_generate(
            target.model,
            target.tokenizer,
            mx.array(prompt_tokens(target.tokenizer, req)),
            max_tokens=req.max_tokens,
            sampler=make_sampler(0.0),
            **kwargs,
        ):
            grown_from = len(text)
            text += r.text
            last = r
            if (cut := stops.find(text, grown_from)) >= 0:
                text = text[:cut]
                break
        tokens += last.generation_tokens
        texts.append(text)
    return tokens, time.perf_counter() - start, texts


def queued(conn: Redis, cache: ModelCache, reqs: list[dict]) -> tuple[int, float, list[str]]:
    """Submit through the producer API and run a burst worker: (tokens, seconds, texts)."""
    # "always": the same decoding as the direct calls (k=3), so the ratio is overhead only.
    policy = SpeculationPolicy("always", default_k=3)
    rt = runtime.WorkerRuntime(cache=cache, worker_id="bench", policy=policy)
    records, elapsed = burst(conn, reqs, rt)
    tokens = sum(r.response.usage.completion_tokens for r in records if r.response)
    return tokens, elapsed, [r.response.choices[0].message.content for r in records if r.response]


def cold_warm(conn: Redis, target: str, draft: str | None) -> dict:
    cache = ModelCache()
    rt = runtime.WorkerRuntime(cache=cache, worker_id="bench")
    out = {}
    for label in ("cold", "warm"):
        (record,), _ = burst(conn, requests(target, draft, 16)[:1], rt)
        m = record.metrics
        out[label] = {
            "total_s": round(m.total_time_s, 4),
            "load_s": round(m.load_time_s, 4),
            "cache_hit": m.cache_hit,
        }
    out["cold_over_warm"] = round(out["cold"]["total_s"] / out["warm"]["total_s"], 2)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target")
    ap.add_argument("--draft")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--halves", default="plain,speculative", help="which halves to run")
    args = ap.parse_args()
    target, draft = (args.target, args.draft) if args.target else bench_pair()
    OUT.mkdir(exist_ok=True)
    report: dict = {
        "target": target,
        "draft": draft,
        "synthetic": not args.target,
        "prompts": len(TOPICS),
        "max_tokens": args.max_tokens,
    }
    cache = ModelCache()
    with LocalRedis() as server:
        conn = Redis.from_url(server.url)
        for label, d in (("plain", None), ("speculative", draft)):
            if label not in args.halves.split(","):
                continue
            reqs = requests(target, d, args.max_tokens)
            direct(cache, reqs[:1])  # warm both paths' models and kernels
            want: list[str] = []
            rates: dict[str, list[float]] = {"direct": [], "worker": []}
            ratios = []
            for _ in range(args.rounds):
                # ABBA order within a round, so drift and ordering effects cancel.
                round_rates: dict[str, list[float]] = {"direct": [], "worker": []}
                for side in ("direct", "worker", "worker", "direct"):
                    conn.flushall()
                    n, t, got = (
                        direct(cache, reqs) if side == "direct" else queued(conn, cache, reqs)
                    )
                    round_rates[side].append(n / t)
                    if side == "direct":
                        want = got
                    else:
                        assert got == want, "worker output differs from direct mlx-lm output"
                for side, values in round_rates.items():
                    rates[side].extend(values)
                ratios.append(
                    statistics.mean(round_rates["worker"]) / statistics.mean(round_rates["direct"])
                )
            report[label] = {
                "direct_tok_s": round(statistics.median(rates["direct"]), 1),
                "worker_tok_s": round(statistics.median(rates["worker"]), 1),
                "worker_over_direct": round(statistics.median(ratios), 3),
                "ratio_per_round": [round(r, 3) for r in ratios],
            }
            print(label, report[label], flush=True)
        conn.flushall()
        report["cold_vs_warm"] = cold_warm(conn, target, draft)
    (OUT / "worker.json").write_text(json.dumps(report, indent=1))
    halves = [m for m in ("plain", "speculative") if m in report]
    grouped_bars(
        OUT / "worker.png",
        "Tokens/s: producer -> Redis -> worker vs mlx_lm.stream_generate",
        halves,
        {side: [report[m][f"{side}_tok_s"] for m in halves] for side in ("direct", "worker")},
        "tokens/s (median)",
    )
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
