"""Batch size by memory and measurement: ``--max-batch auto`` vs fixed sizes vs mlx_lm.server.

Throughput, side by side in one run: N greedy jobs of ``--max-tokens`` tokens
(distinct short prompts) queued at once on the 12x1024 target, served by

- mlxq with its defaults (``--max-batch auto``), from a fresh worker each time
  (cold: nothing measured, it starts at 32 and grows while a larger batch
  measures faster) and with one that keeps what it measured (warm: a worker
  that has served before);
- mlxq at each fixed ``--max-batch`` in 4, 8, 16, 32;
- ``mlx_lm.server`` with its defaults, every request sent at once.

for N in 16 and 64. Every mlxq arm runs in one in-process worker (real Redis,
real lifecycle, real records) with the model loaded and batches warmed first.
This machine is noisy: every arm runs ``--rounds`` times, the order rotating
each round, and the figures are medians.

Joining: a ~2,000-token prompt joins 8 sequences that are decoding; the
longest step they wait for and the joiner's time to first token, with
mlxq's prefill chunk (512 tokens per step) and mlx-lm's default (2,048).

Memory: 12 jobs with ~2,000-token prompts and a ``--cache-gb`` budget that
leaves KV room for 6 of them: auto (it holds 6 at most) vs the best fixed size
without a budget (it holds all 12); peak memory (MLX's peak allocation), the
largest batch, peak KV bytes, and tokens/s.

    .venv/bin/python -m bench.batchsize [--jobs 16 64] [--max-tokens 64] [--fixed 4 8 16 32]
        [--rounds 3] [--parts throughput join memory] [--memory-fixed N]
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
from redis import Redis

from bench.fixtures import model
from bench.peer import mlx_lm_server, send_all
from bench.plots import grouped_bars
from bench.serve import burst
from producer.localredis import LocalRedis
from schemas import ChatRequest
from worker.engine import Prepared, params_for, prompt_tokens
from worker.engine.batch import BatchEngine
from worker.engine.models import ModelCache
from worker.engine.prefill import PREFILL_STEP
from worker.runner import runtime
from worker.schedule.admission import batch_peak_bytes
from worker.schedule.policy import SpeculationPolicy

OUT = Path(__file__).parent / "out"
PARTS = ["throughput", "join", "memory"]
TOPICS = "queues leases batches caches drafts fleets tokens prompts workers records".split()


def filler(tokenizer, n_tokens: int) -> str:
    """Words that make a prompt about ``n_tokens`` tokens long."""
    words: list[str] = []
    while len(tokenizer.encode(" ".join(words))) < n_tokens:
        words.extend(TOPICS)
    return " ".join(words)


def bodies(target: str, n: int, max_tokens: int, extra: str = "", tag: str = "") -> list[dict]:
    """``n`` greedy jobs with distinct prompts (``extra`` text makes them long)."""
    return [
        {
            "model": target,
            "temperature": 0,
            "max_tokens": max_tokens,
            "messages": [
                {"role": "user", "content": f"{tag}Job {i}: {extra} about {TOPICS[i % 10]}."}
            ],
        }
        for i in range(n)
    ]


def through_worker(
    conn: Redis, jobs: list[dict], cache: ModelCache, policy: SpeculationPolicy, max_batch
) -> dict:
    rt = runtime.WorkerRuntime(cache=cache, worker_id="bench-batchsize", policy=policy)
    mx.reset_peak_memory()
    records, elapsed = burst(conn, jobs, rt, max_batch)
    tokens = sum(r.response.usage.completion_tokens for r in records)
    return {
        "tok_s": tokens / elapsed,
        "seconds": elapsed,
        "tokens": tokens,
        "largest_batch": max(r.metrics.batch_size for r in records),
        "peak_memory_mb": mx.get_peak_memory() / 1e6,
        "peak_kv_mb": rt.stats.peak_kv_bytes / 1e6,
        "projected_kv_mb": rt.stats.peak_projected_kv_bytes / 1e6,
        "texts": [r.response.choices[0].message.content for r in records],
    }


def through_server(port: int, jobs: list[dict]) -> dict:
    replies, elapsed = send_all(port, jobs)
    tokens = sum(r["usage"]["completion_tokens"] for r in replies)
    return {
        "tok_s": tokens / elapsed,
        "seconds": elapsed,
        "tokens": tokens,
        "texts": [r["choices"][0]["message"]["content"] for r in replies],
    }


def throughput(
    url: str, target: str, n: int, max_tokens: int, fixed: list[int], rounds: int
) -> dict:
    """Every arm ``rounds`` times, the order rotating each round; medians."""
    conn = Redis.from_url(url)
    cache = ModelCache()
    cache.get(target)
    through_worker(conn, bodies(target, 8, 4, tag="warm "), cache, SpeculationPolicy(), 8)
    jobs = bodies(target, n, max_tokens)
    warm = SpeculationPolicy()  # keeps what it measured across rounds
    through_worker(conn, jobs, cache, warm, None)  # its first (cold) pass
    arms: dict[str, Callable[[], dict]] = {
        "auto (cold)": lambda: through_worker(conn, jobs, cache, SpeculationPolicy(), None),
        "auto (warm)": lambda: through_worker(conn, jobs, cache, warm, None),
    }
    for size in fixed:
        arms[f"fixed {size}"] = functools.partial(
            through_worker, conn, jobs, cache, SpeculationPolicy(), size
        )
    runs: dict[str, list[dict]] = {a: [] for a in [*arms, "mlx_lm.server"]}
    with mlx_lm_server(target) as port:
        send_all(port, bodies(target, n, 4, tag="warm "))  # its batches warmed too
        arms["mlx_lm.server"] = lambda: through_server(port, jobs)
        names = list(arms)
        for r in range(rounds):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                runs[name].append(arms[name]())
                print(
                    f"  {n} jobs, round {r + 1}, {name}: {runs[name][-1]['tok_s']:.1f} tok/s",
                    file=sys.stderr,
                    flush=True,
                )
    tok_s = {a: statistics.median(x["tok_s"] for x in v) for a, v in runs.items()}
    best = max((a for a in tok_s if a.startswith("fixed")), key=lambda a: tok_s[a])
    server = tok_s["mlx_lm.server"]
    reference = runs[f"fixed {fixed[0]}"][0]["texts"]
    return {
        "jobs": n,
        "rounds": rounds,
        "tok_s_median": {a: round(v, 1) for a, v in tok_s.items()},
        "tok_s_per_round": {a: [round(x["tok_s"], 1) for x in v] for a, v in runs.items()},
        "largest_batch": {
            a: v[-1]["largest_batch"] for a, v in runs.items() if a != "mlx_lm.server"
        },
        "best_fixed": best,
        "auto_warm_over_server": round(tok_s["auto (warm)"] / server, 3),
        "auto_cold_over_server": round(tok_s["auto (cold)"] / server, 3),
        "auto_warm_over_best_fixed": round(tok_s["auto (warm)"] / tok_s[best], 3),
        "auto_cold_over_best_fixed": round(tok_s["auto (cold)"] / tok_s[best], 3),
        "auto_warm_over_server_per_round": [
            round(a["tok_s"] / b["tok_s"], 3)
            for a, b in zip(runs["auto (warm)"], runs["mlx_lm.server"], strict=True)
        ],
        "auto_warm_over_best_fixed_per_round": [
            round(a["tok_s"] / b["tok_s"], 3)
            for a, b in zip(runs["auto (warm)"], runs[best], strict=True)
        ],
        "measured_rates": {
            str(s): round(a.value, 1)
            for s, a in sorted(warm.sizes.plain[(target, None)].by_size.items())
        },
        "auto_limit_after": warm.sizes.limit(target, None)[1],
        "mlxq_outputs_equal": all(
            x["texts"] == reference for a, v in runs.items() if a != "mlx_lm.server" for x in v
        ),
        "server_outputs_equal": sum(
            a == b for a, b in zip(runs["mlx_lm.server"][0]["texts"], reference, strict=True)
        ),
    }


def memory(url: str, target: str, best_fixed: int, n: int = 12, fits: int = 6) -> dict:
    conn = Redis.from_url(url)
    probe = ModelCache()
    entry = probe.get(target)[0]
    jobs = bodies(target, n, 16, filler(entry.tokenizer, 1990), tag="long ")
    prompts = [len(prompt_tokens(entry.tokenizer, ChatRequest.model_validate(b))) for b in jobs]
    one = batch_peak_bytes(entry.kv, [(max(prompts), 16)])
    budget = entry.nbytes + fits * one + one // 2
    arms = {}
    for name, cache, max_batch in (
        (f"auto, --cache-gb {budget / 1e9:.2f}", ModelCache(budget, prefix_bytes=0), None),
        (f"fixed {best_fixed}, no budget", ModelCache(prefix_bytes=0), best_fixed),
    ):
        cache.get(target)
        arm = through_worker(conn, jobs, cache, SpeculationPolicy(), max_batch)
        arms[name] = {k: v for k, v in arm.items() if k != "texts"}
        print(f"  memory, {name}: {json.dumps(arms[name])}", file=sys.stderr, flush=True)
    return {
        "jobs": n,
        "prompt_tokens": max(prompts),
        "kv_mb_per_job": round(one / 1e6, 1),
        "weights_mb": round(entry.nbytes / 1e6, 1),
        "budget_mb": round(budget / 1e6, 1),
        "arms": {
            name: {k: round(v, 1) if isinstance(v, float) else v for k, v in arm.items()}
            for name, arm in arms.items()
        },
    }


def join_stall(target: str, running: int = 8, joiner_tokens: int = 2000) -> dict:
    """A long prompt joins a batch that is decoding: the longest step the running
    sequences wait for, and the joiner's time to first token, by prefill chunk size."""
    entry = ModelCache().get(target)[0]
    short = [ChatRequest.model_validate(b) for b in bodies(target, running, 96)]
    (long_body,) = bodies(target, 1, 8, filler(entry.tokenizer, joiner_tokens), tag="long ")
    long_req = ChatRequest.model_validate(long_body)
    report = {}
    for chunk in (PREFILL_STEP, 2048, PREFILL_STEP):  # the first pass warms up
        engine = BatchEngine(entry, running + 1, prefill_step=chunk)
        for i, req in enumerate(short):
            prompt = prompt_tokens(entry.tokenizer, req)
            engine.add(i, Prepared(prompt, params_for(req, len(prompt), entry.context_length, 512)))
        for _ in range(4):
            engine.step()
        prompt = prompt_tokens(entry.tokenizer, long_req)
        engine.add(
            "long", Prepared(prompt, params_for(long_req, len(prompt), entry.context_length, 512))
        )
        joined, steps, first = time.perf_counter(), [], None
        while first is None:
            t = time.perf_counter()
            engine.step()
            steps.append(time.perf_counter() - t)
            if engine.first_token_at("long") is not None:
                first = engine.first_token_at("long") - joined
        engine.close()
        report[f"prefill chunk {chunk}"] = {
            "joiner_prompt_tokens": len(prompt),
            "longest_step_s": round(max(steps), 2),
            "steps_until_first_token": len(steps),
            "joiner_ttft_s": round(first, 2),
        }
    return report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default=None, help="model path or hub id [default: 12x1024]")
    ap.add_argument("--jobs", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--fixed", type=int, nargs="+", default=[4, 8, 16, 32])
    ap.add_argument("--rounds", type=int, default=3, help="rounds of every arm (medians)")
    ap.add_argument("--parts", nargs="+", default=PARTS, choices=PARTS)
    ap.add_argument(
        "--memory-fixed",
        type=int,
        default=None,
        help="the fixed size the memory part compares with [default: the best "
        "fixed size of the throughput part, else 32]",
    )
    args = ap.parse_args()
    target = args.target or model("wide")
    report: dict = {"target": target, "max_tokens": args.max_tokens, "runs": []}
    with LocalRedis() as server:
        if "throughput" in args.parts:
            for n in args.jobs:
                run = throughput(server.url, target, n, args.max_tokens, args.fixed, args.rounds)
                report["runs"].append(run)
                print(json.dumps(run), flush=True)
        if "join" in args.parts:
            report["join"] = join_stall(target)
            print(json.dumps(report["join"]), flush=True)
        if "memory" in args.parts:
            best = args.memory_fixed or (
                int(report["runs"][0]["best_fixed"].split()[1]) if report["runs"] else 32
            )
            report["memory"] = memory(server.url, target, best)
            print(json.dumps(report["memory"]), flush=True)
    OUT.mkdir(exist_ok=True)
    name = "batchsize.json" if args.parts == PARTS else f"batchsize-{'-'.join(args.parts)}.json"
    (OUT / name).write_text(json.dumps(report, indent=1))
    if not report["runs"]:
        return
    arms = list(report["runs"][0]["tok_s_median"])
    grouped_bars(
        OUT / "batchsize.png",
        f"greedy jobs x {args.max_tokens} tokens queued at once (12x1024 target)",
        [f"{r['jobs']} jobs" for r in report["runs"]],
        {a: [r["tok_s_median"][a] for r in report["runs"]] for a in arms},
        "tokens/s",
    )


if __name__ == "__main__":
    main()
