"""Structured output's cost: constrained vs free decoding on the 12 x 1024 target.

The target is ``wide32k`` (12 x 1024, a 32,000-entry byte-level BPE). Jobs ask for
the 10-field extraction schema of ``bench/grammar.py``; the same prompts run free
(``response_format`` text) as the baseline, pair by pair, alternating, so noise
hits both alike:

- alone: decode seconds per token (total minus time to first token, over the
  tokens after the first), constrained / free, median over prompts;
- a batch of 8 (``BatchEngine``): seconds per decoding step while all 8 decode
  (prefill steps left out), constrained / free, median over rounds;
- compile: the first constrained job on a tokenizer (llguidance's tokenizer set-up
  plus the schema) and a new schema on a tokenizer already set up;
- choices: one job with ``n`` = 8 vs 8 separate jobs of the same prompt (a few-shot
  prompt of ~400 tokens, sampled, seeded), both through a real worker and Redis:
  the separate jobs (unseeded: seeded sampling jobs never share a batch) batched
  (``--max-batch auto``, the default) and one at a time;
  completion tokens per second from submit to the last result.

``--constraint regex|choice|grammar``: the cost part with vLLM's ``structured_outputs``
(a one-line record by regex or lark grammar, a country by choice) instead of the schema.

    bench/run bench.structured [--rounds 3] [--tokens 48] [--parts cost,choices]
        [--constraint json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

from bench.fixtures import model
from bench.grammar import SCHEMA
from schemas import ChatRequest
from worker.engine import prompt_tokens
from worker.engine.batch import BatchEngine
from worker.engine.constrain import constraint_for
from worker.engine.generator import ChatGenerator
from worker.engine.models import ModelCache

PROMPTS = [
    f"Extract the customer record from message {i}: {text}"
    for i, text in enumerate(
        [
            "Alice Smith, 31, alice@example.com, lives at 12 Market Street, Leeds.",
            "Bob from Lyon (bob.martin@mail.fr) joined in March, score 77.",
            "Customer Kenji, age 44, phone +81 3 1234 5678, tags: vip, early.",
            "Maria Souza, Brazil, newsletter subscriber since 2021-05-02.",
            "Hans Weber, 58, Berlin, 10115, hans@weber.de, not a customer yet.",
            "Priya, 27, London, priya@example.co.uk, beta tester, score 91.5.",
            "Tom O'Neil, Boston, MA 02110, +1 617 555 0100, priority.",
            "Yuki Tanaka, 35, Osaka, yuki.t@example.jp, joined 2019-11-23.",
        ]
    )
]


#: ``--constraint``: the JSON schema (``response_format``), or ``structured_outputs``' regex,
#: choice or lark grammar for the same extraction (a one-line record).
CONSTRAINTS: dict[str, dict[str, Any]] = {
    "json": {
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "customer", "schema": SCHEMA},
        }
    },
    "regex": {
        "structured_outputs": {
            "regex": r"[A-Z][a-z]+( [A-Z][a-z']+){0,2}, [0-9]{1,3}, "
            r"[a-z0-9.]+@[a-z0-9]+\.[a-z]{2,6}, (US|GB|DE|FR|JP|BR), (yes|no)"
        }
    },
    "choice": {"structured_outputs": {"choice": ["US", "GB", "DE", "FR", "JP", "BR"]}},
    "grammar": {
        "structured_outputs": {
            "grammar": 'start: name ", " age ", " country ", " tags\n'
            "name: /[A-Z][a-z]+( [A-Z][a-z']+){0,2}/\n"
            "age: /[0-9]{1,3}/\n"
            'country: "US" | "GB" | "DE" | "FR" | "JP" | "BR"\n'
            'tags: tag (" " tag){0,4}\n'
            "tag: /[a-z]{2,10}/"
        }
    },
}


def request(
    target: str, prompt: str, constrained: bool, tokens: int, kind: str = "json"
) -> ChatRequest:
    body: dict[str, Any] = {
        "model": target,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": tokens,
        "temperature": 0,
    }
    return ChatRequest.model_validate(body | (CONSTRAINTS[kind] if constrained else {}))


def per_token_alone(gen: ChatGenerator, req: ChatRequest) -> tuple[float, int, str]:
    out = gen.generate(req)
    n = out.completion_tokens
    return (out.total_time_s - out.time_to_first_token_s) / max(n - 1, 1), n, out.finish_reason


def per_step_batched(gen: ChatGenerator, reqs: list[ChatRequest]) -> tuple[float, int]:
    """Median seconds per decoding step while every sequence decodes; steps measured."""
    engine = BatchEngine(gen.target, len(reqs))
    try:
        for i, req in enumerate(reqs):
            engine.add(i, gen.prepare(req))
        times = []
        while len(engine) == len(reqs):
            t = time.perf_counter()
            step = engine.step()
            elapsed = time.perf_counter() - t
            if not step.prefilled and step.tokens == len(reqs) and not step.done:
                times.append(elapsed)
        return statistics.median(times), len(times)
    finally:
        engine.close()


def compile_times(gen: ChatGenerator) -> dict[str, float]:
    from mlx_lm.utils import hf_repo_to_path, load_tokenizer

    name = gen.target.key[0]
    path = Path(name) if Path(name).exists() else hf_repo_to_path(name)  # hub: downloaded
    tok = load_tokenizer(path)  # a tokenizer llguidance has not seen, as on a fresh worker
    req = request(gen.target.key[0], PROMPTS[0], True, 8)
    t = time.perf_counter()
    constraint_for(req, tok, gen.target.vocab_size)
    first = time.perf_counter() - t
    other = json.loads(json.dumps(SCHEMA))
    other["description"] = f"variant {time.time()}"  # a schema not seen before
    req2 = ChatRequest.model_validate(
        req.model_dump(by_alias=True)
        | {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "v", "schema": other},
            }
        }
    )
    t = time.perf_counter()
    constraint_for(req2, tok, gen.target.vocab_size)
    return {"first_job_s": first, "new_schema_s": time.perf_counter() - t}


SHORT = "Review: Speculative decoding doubled our speed on code, not on chat.\nSentiment:"


REVIEWS = [
    ("The worker kept every model warm and the queue drained fast.", "positive"),
    ("Jobs vanished when the machine rebooted and nobody noticed.", "negative"),
    ("Fast on short prompts, but long documents timed out twice.", "mixed"),
    ("Setup took five minutes and the results were exactly as promised.", "positive"),
    ("The dashboard is pretty but the numbers never add up.", "negative"),
    ("Great throughput on the minis, though memory use surprised us.", "mixed"),
]


def few_shot(repeats: int) -> str:
    """A few-shot classification prompt: the examples ``repeats`` times (3: ~480 tokens)."""
    head = (
        "Classify the sentiment of each review as positive, negative or mixed, then say "
        "why in one sentence.\n"
    )
    shots = "".join(f"Review: {r}\nSentiment: {s}\n" for r, s in REVIEWS * repeats)
    return head + shots + SHORT


def choices(target: str, rounds: int, tokens: int, shots: int) -> dict[str, Any]:
    from redis import Redis

    from bench.serve import burst
    from producer.localredis import LocalRedis
    from worker.runner import runtime

    def body(n: int, seed: int | None) -> dict[str, Any]:
        return {
            "model": target,
            "messages": [{"role": "user", "content": few_shot(shots) if shots else SHORT}],
            "max_tokens": tokens,
            "temperature": 0.8,
            "seed": seed,
            "n": n,
            "logit_bias": {str(i): -100 for i in eos_ids},  # every choice runs to max_tokens
        }

    cache = ModelCache()
    entry, _ = cache.get(target)
    eos_ids = sorted(entry.tokenizer.eos_token_ids)
    prompt = len(prompt_tokens(entry.tokenizer, ChatRequest.model_validate(body(1, 0))))
    arms: dict[str, list[float]] = {"n=8": [], "8 jobs, batched": [], "8 jobs, one at a time": []}
    with LocalRedis() as server:
        conn = Redis.from_url(server.url)
        for r in range(rounds):
            for arm in arms:
                rt = runtime.WorkerRuntime(cache=cache, worker_id=f"bench-{r}")
                # Separate jobs without a seed: seeded sampling jobs run one at a time.
                bodies = [body(8, r)] if arm == "n=8" else [body(1, None) for _ in range(8)]
                max_batch = 1 if "one at a time" in arm else None
                records, elapsed = burst(conn, bodies, rt, max_batch)
                done = sum(x.response.usage.completion_tokens for x in records if x.response)
                arms[arm].append(done / elapsed)
                print(f"  round {r} {arm}: {done} tokens in {elapsed:.1f} s")
    med = {arm: statistics.median(v) for arm, v in arms.items()}
    return {
        "prompt_tokens": prompt,
        "tokens_per_s": arms,
        "n8_vs_batched": med["n=8"] / med["8 jobs, batched"],
        "n8_vs_one_at_a_time": med["n=8"] / med["8 jobs, one at a time"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default=None, help="a model path or hub id (default: wide32k)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=48, help="max_tokens per job")
    ap.add_argument("--parts", default="cost,choices")
    ap.add_argument("--constraint", default="json", choices=sorted(CONSTRAINTS))
    ap.add_argument(
        "--shots", type=int, default=3, help="choices: few-shot repeats (0: a one-line prompt)"
    )
    args = ap.parse_args()
    target = args.target or model("wide32k")
    result: dict[str, Any] = {"target": target}
    if "choices" in args.parts:
        result["choices"] = c = choices(target, args.rounds, args.tokens, args.shots)
        print(
            f"n=8 vs 8 separate jobs: {c['n8_vs_batched']:.2f}x batched, "
            f"{c['n8_vs_one_at_a_time']:.2f}x one at a time (prompt {c['prompt_tokens']} tokens)"
        )
    if "cost" not in args.parts:
        print(json.dumps(result))
        return
    gen = ChatGenerator.get_or_create(target, cache=ModelCache())
    result["compile"] = compile_times(gen)
    kind = result["constraint"] = args.constraint
    gen.generate(request(target, PROMPTS[0], True, 4, kind))  # warm both paths
    gen.generate(request(target, PROMPTS[0], False, 4))

    ratios, finished, tokens = [], 0, 0
    for prompt in PROMPTS:
        for _ in range(args.rounds):
            free, _, _ = per_token_alone(gen, request(target, prompt, False, args.tokens))
            con, n, finish = per_token_alone(gen, request(target, prompt, True, args.tokens, kind))
            ratios.append(con / free)
        finished += finish == "stop"
        tokens += n
    result["alone"] = {
        "ratio_median": statistics.median(ratios),
        "ratio_mean": statistics.fmean(ratios),
        "constrained_jobs_finished_json": f"{finished}/{len(PROMPTS)}",
        "constrained_tokens_per_job": tokens / len(PROMPTS),
    }
    print(f"alone: constrained / free seconds per token, median {statistics.median(ratios):.3f}")

    batch_ratios, steps = [], []
    for _ in range(args.rounds):
        free, _ = per_step_batched(gen, [request(target, p, False, args.tokens) for p in PROMPTS])
        con, n = per_step_batched(
            gen, [request(target, p, True, args.tokens, kind) for p in PROMPTS]
        )
        batch_ratios.append(con / free)
        steps.append((free, con, n))
    result["batch8"] = {
        "ratio_median": statistics.median(batch_ratios),
        "step_s_free_constrained_measured": steps,
    }
    ratio = statistics.median(batch_ratios)
    print(f"batch of 8: constrained / free seconds per step, median {ratio:.3f}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
