"""Prompt lookup (speculation without a draft model) against plain decoding, side by side.

Two workloads of ``--jobs`` greedy jobs each (synthetic models, ``bench.fixtures``):

- **copy-heavy**: extraction jobs on ``quote32k`` (12 x 1024, fp32, 32k byte-level
  BPE) whose answers quote 60-80% of their prompts (the model replays the end of
  its prompt: ``TinySpec.quote``);
- **free text**: the same prompts on ``free32k`` (same size and tokenizer, random
  weights scaled so that its text varies: nothing in it repeats or copies);
- with ``--real``, both kinds on Gemma 3 270M (``worker.gguf.bundled``): extraction
  prompts it answers by quoting, and story prompts.

Per workload, every job runs plainly and by prompt lookup (fixed ``--k``) one at a
time, the arms alternating job by job (noise hits both alike), and through auto
(``--speculative auto --lookup auto``'s policy, cold: it measures its arms on these
jobs); then all jobs through a continuous batch of ``--batch`` rows, plain
(``BatchEngine``) and by lookup (``SpecBatchEngine`` without a draft, k per round
chosen by goodput as the worker does). Also the lookup's own cost per step
(microseconds) against a decode step. Greedy text must be equal in every arm.

    LD_PRELOAD=.../libblas.so.3 .venv/bin/python -m bench.lookup [--jobs 16] [--batch 8]
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path
from typing import Any

from bench.fixtures import model
from schemas import ChatRequest
from worker.engine.batch import BatchEngine
from worker.engine.generator import ChatGenerator
from worker.engine.lookup import NgramIndex
from worker.engine.models import ModelCache
from worker.engine.protocol import Engine
from worker.engine.specbatch import SpecBatchEngine
from worker.runner.alone import speed_of
from worker.schedule.goodput import Goodput
from worker.schedule.policy import LOOKUP, SpeculationPolicy

OUT = Path(__file__).parent / "out"
CITIES = "berlin lisbon osaka denver lagos quito perth oslo cairo lima".split()
GOODS = "apples pears crates tiles cables lamps chairs valves sensors boards".split()


def record_text(rng: random.Random, words: int) -> str:
    """A shipping record of about ``words`` words (what an extraction job quotes)."""
    parts = []
    while sum(len(p.split()) for p in parts) < words:
        n, city, good = rng.randint(10, 9999), rng.choice(CITIES), rng.choice(GOODS)
        parts.append(f"order {n} ships {rng.randint(2, 90)} {good} to {city} on dock {n % 7};")
    return " ".join(parts)


def extraction_jobs(gen: ChatGenerator, n: int, quote: int, seed: int = 0) -> list[ChatRequest]:
    """``n`` jobs whose content is sized so that the model's answer (the last ``quote``
    prompt tokens, up to the end of the user's turn) is 60-80% of it."""
    rng, reqs = random.Random(seed), []
    tok = gen.target.tokenizer
    for i in range(n):
        share = 0.6 + 0.2 * i / max(n - 1, 1)
        words = 10
        while True:
            text = "Extract the shipping lines: " + record_text(rng, words)
            if len(tok.encode(text)) * share >= quote:
                break
            words += 4
        reqs.append(_req(gen, text, 2 * quote))
    return reqs


TOPICS = ["a lighthouse keeper", "a lost map", "a robot gardener", "the last train"]


def real_jobs(gen: ChatGenerator, kind: str, n: int, max_tokens: int) -> list[ChatRequest]:
    """Prompts for a real model: logs to rewrite keeping every word (copy-heavy), or
    stories (free text)."""
    rng = random.Random(1)
    if kind == "copy-heavy":
        contents = [
            "Rewrite this shipping log as a list, one order per line, keeping every word:\n"
            + record_text(rng, 50).replace("; ", ";\n")
            for _ in range(n)
        ]
    else:
        contents = [f"Write a short story about {TOPICS[i % len(TOPICS)]}." for i in range(n)]
    return [_req(gen, c, max_tokens) for c in contents]


def _req(gen: ChatGenerator, content: str, max_tokens: int) -> ChatRequest:
    body = {"model": gen.target.name, "messages": [{"role": "user", "content": content}]}
    return ChatRequest.model_validate(body | {"max_tokens": max_tokens, "temperature": 0})


def alone(gen: ChatGenerator, reqs: list[ChatRequest], k: int) -> dict[str, Any]:
    """Plain and lookup one at a time, alternating; tokens/s over the whole jobs."""
    arms: dict[str, dict[str, Any]] = {
        a: {"tokens": 0, "s": 0.0, "texts": []} for a in ("plain", "lookup")
    }
    proposed = accepted = 0
    for i, req in enumerate(reqs):
        job = gen.prepare(req)
        order = ("plain", "lookup") if i % 2 == 0 else ("lookup", "plain")
        for arm in order:
            start = time.perf_counter()
            if arm == "plain":
                out = gen.generate(job, use_draft=False)
            else:
                out = gen.generate(job.with_params(num_draft_tokens=k), lookup=job.params.lookup)
                proposed += out.draft_tokens_proposed
                accepted += out.draft_tokens_accepted
            a = arms[arm]
            a["s"] += time.perf_counter() - start
            a["tokens"] += out.completion_tokens
            a["texts"].append(out.text)
    rates = {a: v["tokens"] / v["s"] for a, v in arms.items()}
    return {
        "tokens_per_s": {a: round(r, 2) for a, r in rates.items()},
        "lookup_over_plain": round(rates["lookup"] / rates["plain"], 3),
        "acceptance": round(accepted / proposed, 3) if proposed else None,
        "accepted_share_of_tokens": round(accepted / max(arms["lookup"]["tokens"], 1), 3),
        "texts_equal": sum(
            p == q for p, q in zip(arms["plain"]["texts"], arms["lookup"]["texts"], strict=True)
        ),
        "_texts": arms["plain"]["texts"],
    }


def auto(gen: ChatGenerator, reqs: list[ChatRequest]) -> dict[str, Any]:
    """The jobs one at a time as a cold auto policy (``--lookup auto``) chooses, each
    beside a plain run of the same job (alternating which goes first: noise hits both)."""
    policy = SpeculationPolicy("auto", lookup="auto")
    target = gen.target.name
    arms = {a: {"tokens": 0, "s": 0.0} for a in ("auto", "plain")}
    jobs_seen, texts = [], []
    for i, req in enumerate(reqs):
        job = gen.prepare(req)
        for arm in ("auto", "plain") if i % 2 == 0 else ("plain", "auto"):
            start = time.perf_counter()
            if arm == "plain":
                out = gen.generate(job, use_draft=False)
            else:
                decision = policy.choose(target, LOOKUP)
                if decision.speculative:
                    spec = job.with_params(num_draft_tokens=decision.k)
                    out = gen.generate(
                        spec, lookup=job.params.lookup, give_up_below=decision.give_up_below
                    )
                else:
                    out = gen.generate(job, use_draft=False)
                policy.record(target, LOOKUP, decision, speed_of(out))
                jobs_seen.append(
                    {
                        "k": decision.k,
                        "proposed": out.draft_tokens_proposed,
                        "accepted": out.draft_tokens_accepted,
                        "idle_rounds": out.idle_rounds,
                        "gave_up_after": out.gave_up_after,
                    }
                )
                texts.append(out.text)
            arms[arm]["s"] += time.perf_counter() - start
            arms[arm]["tokens"] += out.completion_tokens
    rates = {a: v["tokens"] / v["s"] for a, v in arms.items()}
    return {
        "tokens_per_s": {a: round(r, 2) for a, r in rates.items()},
        "auto_over_plain_beside_it": round(rates["auto"] / rates["plain"], 3),
        "k_chosen": [j["k"] for j in jobs_seen],
        "jobs": jobs_seen,
        "_texts": texts,
    }


def batched(gen: ChatGenerator, reqs: list[ChatRequest], width: int) -> dict[str, Any]:
    """All jobs through a continuous batch of ``width`` rows (a finished row's slot is
    filled at the next step), plain and by lookup with goodput's k per round."""
    out: dict[str, Any] = {}
    for arm in ("plain", "lookup", "plain again"):
        engine: Engine
        if arm == "lookup":
            engine = SpecBatchEngine(gen.target, None, 8, Goodput(8))
        else:
            engine = BatchEngine(gen.target, width)
        jobs = [gen.prepare(r) for r in reqs]
        waiting, texts, tokens = list(enumerate(jobs)), {}, 0
        start = time.perf_counter()
        while waiting or len(engine):
            while waiting and len(engine) < width:
                i, job = waiting.pop(0)
                engine.add(i, job)
            for tag, o in engine.step().done:
                assert not isinstance(o, Exception), o
                texts[tag] = o.text
                tokens += o.completion_tokens
        elapsed = time.perf_counter() - start
        engine.close()
        out[arm] = {"tokens_per_s": round(tokens / elapsed, 2), "_texts": texts}
    plain = (out["plain"]["tokens_per_s"] + out["plain again"]["tokens_per_s"]) / 2
    return {
        "tokens_per_s": {a: v["tokens_per_s"] for a, v in out.items()},
        "lookup_over_plain": round(out["lookup"]["tokens_per_s"] / plain, 3),
        "texts_equal": sum(
            out["plain"]["_texts"][i] == out["lookup"]["_texts"][i] for i in range(len(reqs))
        ),
    }


def lookup_cost_us(gen: ChatGenerator, req: ChatRequest, steps: int = 2000) -> float:
    """Microseconds per step of the lookup itself (catch up one token, propose)."""
    prompt = gen.prepare(req).prompt
    index = NgramIndex(gen.prepare(req).params.lookup, prompt[: len(prompt) // 2])
    history = list(prompt[: len(prompt) // 2])
    rest = prompt[len(prompt) // 2 :] * (steps // max(len(prompt) // 2, 1) + 1)
    start = time.perf_counter()
    for t in rest[:steps]:
        history.append(t)
        index.sync(history)
        index.propose(8)
    return (time.perf_counter() - start) / steps * 1e6


def workload(name: str, target: str, args: argparse.Namespace) -> dict[str, Any]:
    gen = ChatGenerator.get_or_create(target, cache=ModelCache(prefix_bytes=0))
    if name.startswith("real "):
        reqs = real_jobs(gen, name.removeprefix("real "), args.real_jobs, args.real_tokens)
    elif name == "copy-heavy":
        reqs = extraction_jobs(gen, args.jobs, args.quote)
    else:  # free text: the same prompts, a model with nothing to copy from them
        quote_gen = ChatGenerator.get_or_create(model("quote32k"), cache=ModelCache())
        reqs = [
            _req(gen, r.messages[0].text, 2 * args.quote)
            for r in extraction_jobs(quote_gen, args.jobs, args.quote)
        ]
    gen.generate(reqs[0].model_copy(update={"max_tokens": 4}))  # warm up
    one = alone(gen, reqs, args.k)
    result: dict[str, Any] = {"model": Path(target).name, "jobs": len(reqs), "alone": one}
    result["auto"] = auto(gen, reqs)
    result["auto"]["texts_equal"] = sum(
        a == b for a, b in zip(result["auto"].pop("_texts"), one.pop("_texts"), strict=True)
    )
    result["batch"] = batched(gen, reqs, args.batch)
    step_s = 1 / one["tokens_per_s"]["plain"]
    cost = lookup_cost_us(gen, reqs[0])
    result["lookup_cost_per_step_us"] = round(cost, 1)
    result["lookup_cost_over_decode_step"] = round(cost / 1e6 / step_s, 6)
    prompt = gen.prepare(reqs[0]).prompt
    result["prompt_tokens"] = len(prompt)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=16)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--k", type=int, default=8, help="lookup's fixed proposal length alone")
    ap.add_argument("--quote", type=int, default=96, help="quote32k's quoted span (tokens)")
    ap.add_argument("--workloads", default="copy-heavy,free-text")
    ap.add_argument("--real", action="store_true", help="also Gemma 3 270M (worker.gguf)")
    ap.add_argument("--real-jobs", type=int, default=6)
    ap.add_argument("--real-tokens", type=int, default=96)
    args = ap.parse_args()
    targets = {"copy-heavy": model("quote32k"), "free-text": model("free32k")}
    names = args.workloads.split(",")
    if args.real:
        from worker.gguf.bundled import ensure

        real = str(ensure(Path(".mlxq/models")).target)
        targets |= {"real copy-heavy": real, "real free-text": real}
        names += ["real copy-heavy", "real free-text"]
    results = {}
    for name in names:
        results[name] = workload(name, targets[name], args)
        print(name, json.dumps(results[name], indent=1), flush=True)
    OUT.mkdir(exist_ok=True)
    (OUT / "lookup.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
