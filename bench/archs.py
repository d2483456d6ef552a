"""Sliding-window and hybrid models: exact speculation, its rewind cost, and the prefix cache.

Two synthetic models of ``wide``'s size (12 x 1024, fp32; ``bench.fixtures``):
``wide-gemma3`` (Gemma 3's shape: 5 sliding-window layers of window 512 to 1 global)
and ``wide-qwen35`` (Qwen3.5's: 3 gated delta-net linear-attention layers to 1 full
attention). Side by side in one run, per model:

- **speculation, one job at a time**: plain greedy decoding vs a copy-style draft
  (``copy``: the target repeats its last token, the draft predicts it) and an
  unrelated one (nearly every proposal rejected, so every round rewinds): tokens/s,
  acceptance, whether the text equals plain, and the rewind cost per round (the
  replay passes recurrent layers need, in seconds, over the verify passes'), on a
  prompt past the sliding window.
- **prefix cache**: ``--jobs`` jobs sharing a ``--system-tokens`` system prompt with
  ``max_tokens`` 8 through an in-process worker with the prefix cache on and off,
  and through ``mlx_lm.server`` (``bench.prefix``).

    .venv/bin/python -m bench.archs [--models wide-gemma3,wide-qwen35] [--jobs 64]
        [--baseline-jobs 16]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache
from redis import Redis

from bench.fixtures import model
from bench.prefix import bodies, system_prompt, through_server, through_worker
from producer.localredis import LocalRedis
from schemas import ChatRequest
from worker.engine.generator import ChatGenerator
from worker.engine.models import ModelCache
from worker.engine.rewind import describe
from worker.engine.specbatch import SpecBatchEngine

OUT = Path(__file__).parent / "out"
WORDS = "queue worker model token draft target redis job batch lease prefix cache fleet "


def _plain(gen: ChatGenerator, req: ChatRequest) -> tuple[list[int], float]:
    out = gen.generate(req)
    return list(out.token_ids), out.generation_tokens_per_s


def _speculative(
    gen: ChatGenerator, prompt: list[int], k: int, max_tokens: int
) -> tuple[list[int], float, dict]:
    """The draft pair's tokens, decode tokens/s (after the first round), and its counts:
    a job alone, as the worker runs it (a speculative engine holding one row)."""
    assert gen.draft is not None
    job = gen.prepare(_req(gen, max_tokens))
    engine = SpecBatchEngine(gen.target, gen.draft, k, solo=True)
    engine.add(0, job)
    first, outs = 0.0, {}
    while len(engine):
        step = engine.step()
        outs.update(step.done)
        if not first:
            first, at_first = time.perf_counter(), step.tokens
    out = outs[0]
    tokens = list(out.token_ids)
    speed = (len(tokens) - at_first) / max(time.perf_counter() - first, 1e-9)
    counts = {
        "proposed": out.draft_tokens_proposed,
        "accepted": out.draft_tokens_accepted,
        "rounds": engine.rounds,
        "replays": engine.replays,
        "replay_over_verify": round(engine.replay_s / max(engine.verify_s, 1e-9), 3),
    }
    return tokens, speed, counts


def _req(gen: ChatGenerator, max_tokens: int, chars: int = 3600) -> ChatRequest:
    """A prompt past the 512-token window (about 700 tokens)."""
    content = (WORDS * (chars // len(WORDS) + 1))[:chars]
    return ChatRequest(
        model=gen.target.name,
        messages=[{"role": "user", "content": content}],
        max_tokens=max_tokens,
        temperature=0,
        logit_bias={"3": -100},  # no EOS: every run decodes max_tokens
    )


def speculation(target: str, cache: ModelCache, max_tokens: int, reps: int) -> dict:
    plain_gen = ChatGenerator.get_or_create(target, cache=cache)
    req = _req(plain_gen, max_tokens)
    prompt = plain_gen.prepare(req).prompt
    plain_gen.generate(_req(plain_gen, 4))  # warm up
    out: dict = {
        "caches": describe(make_prompt_cache(plain_gen.target.model)),
        "prompt_tokens": len(prompt),
        "max_tokens": max_tokens,
    }
    for name, k in (("copy", 4), ("unrelated", 2)):
        gen = ChatGenerator.get_or_create(target, model(name), cache=cache)
        ratios, plain_speeds, spec_speeds, equal, tallies = [], [], [], True, []
        for _ in range(reps):  # plain and speculative back to back, so noise hits both
            ref, plain_tps = _plain(plain_gen, req)
            tokens, spec_tps, tally = _speculative(gen, prompt, k, max_tokens)
            equal = equal and tokens == ref
            ratios.append(spec_tps / plain_tps)
            plain_speeds.append(plain_tps)
            spec_speeds.append(spec_tps)
            tallies.append(tally)
        t = tallies[-1]
        out[name] = {
            "k": k,
            "plain_tok_s": round(statistics.median(plain_speeds), 2),
            "speculative_tok_s": round(statistics.median(spec_speeds), 2),
            "speedup": round(statistics.median(ratios), 3),
            "acceptance": round(t["accepted"] / max(t["proposed"], 1), 3),
            "greedy_equal_to_plain": equal,
            "rounds": t["rounds"],
            "replays": t["replays"],
            "replay_over_verify": t["replay_over_verify"],
        }
        print(target.rsplit("/", 1)[-1], name, out[name], file=sys.stderr, flush=True)
    return out


def prefix(target: str, jobs: int, system_tokens: int, baseline_jobs: int) -> dict:
    """``jobs`` through the cache; the arms without reuse run the first ``baseline_jobs``.

    Without reuse every job pays the same full prefill, so their jobs/s does not depend
    on how many run; the cache arm runs all of them, its first (cold) job included.
    """
    tokenizer = ModelCache().get(target)[0].tokenizer
    reqs = bodies(target, system_prompt(tokenizer, system_tokens), jobs, 8)
    few = reqs[: min(baseline_jobs, jobs)]
    with LocalRedis() as server:
        conn = Redis.from_url(server.url)
        off = through_worker(conn, target, few, 0)
        on = through_worker(conn, target, reqs, 1.0)
    srv = through_server(target, few)
    out = {
        "jobs": jobs,
        "jobs_without_reuse_arms": len(few),
        "prompt_tokens": on["prompt_tokens"],
        "shared_prefix_tokens": max(on["cached_tokens"]),
        "jobs_reusing_the_prefix": sum(1 for c in on["cached_tokens"] if c),
        "jobs_per_s": {
            "cache": round(on["jobs_per_s"], 3),
            "no cache": round(off["jobs_per_s"], 3),
            "mlx_lm.server": round(srv["jobs_per_s"], 3),
        },
        "cache_over_no_cache": round(on["jobs_per_s"] / off["jobs_per_s"], 2),
        "cache_over_mlx_lm_server": round(on["jobs_per_s"] / srv["jobs_per_s"], 2),
        "prefix_cache_mb": round(on["prefix_cache_mb"], 1),
        "outputs_equal_cache_vs_no_cache": on["texts"][: len(few)] == off["texts"],
        "server_outputs_equal_to_mlxq": sum(
            a == b for a, b in zip(srv["texts"], on["texts"][: len(few)], strict=True)
        ),
    }
    print(target.rsplit("/", 1)[-1], "prefix", out, file=sys.stderr, flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="wide-gemma3,wide-qwen35")
    ap.add_argument("--parts", default="speculation,prefix")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--jobs", type=int, default=64)
    ap.add_argument(
        "--baseline-jobs",
        type=int,
        default=None,
        help="jobs for the no-cache and mlx_lm.server arms [default: --jobs]",
    )
    ap.add_argument("--system-tokens", type=int, default=1500)
    args = ap.parse_args()
    parts = args.parts.split(",")
    cache = ModelCache()
    report: dict = {}
    for name in args.models.split(","):
        target = model(name)
        report[name] = {}
        if "speculation" in parts:
            report[name]["speculation"] = speculation(target, cache, args.max_tokens, args.reps)
        if "prefix" in parts:
            mx.clear_cache()
            report[name]["prefix"] = prefix(
                target, args.jobs, args.system_tokens, args.baseline_jobs or args.jobs
            )
    OUT.mkdir(exist_ok=True)
    (OUT / "archs.json").write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))
    bad = [
        n
        for n, r in report.items()
        for arm in ("copy", "unrelated")
        if "speculation" in r and not r["speculation"][arm]["greedy_equal_to_plain"]
    ]
    if bad:
        raise SystemExit(f"speculative greedy output differs from plain on {bad}")


if __name__ == "__main__":
    main()
