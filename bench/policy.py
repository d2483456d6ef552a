"""Speculation policy: auto against fixed choices, per (target, draft) pair, same jobs.

Runs the same N greedy jobs with plain decoding, with fixed draft lengths and
with ``--speculative auto`` (which spends its first jobs measuring every arm),
and reports auto's throughput against the best fixed choice, over all N jobs
and after its exploration. Synthetic models (bench/fixtures.py).

    .venv/bin/python -m bench.policy [--jobs 16] [--max-tokens 32]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from bench.fixtures import model
from bench.plots import grouped_bars
from schemas import ChatRequest
from worker.cache import ModelCache
from worker.generator import ChatGenerator
from worker.policy import DEFAULT_KS, PLAIN, Decision, SpeculationPolicy

OUT = Path(__file__).parent / "out"


def jobs(target: str, draft: str, n: int, max_tokens: int) -> list[ChatRequest]:
    return [
        ChatRequest.model_validate(
            {
                "model": target,
                "draft_model": draft,
                "temperature": 0,
                "max_tokens": max_tokens,
                "messages": [{"role": "user", "content": f"Job {i}: tell me about queues."}],
            }
        )
        for i in range(n)
    ]


def run(gen: ChatGenerator, reqs: list[ChatRequest], choose) -> list[tuple[int, float]]:
    """(tokens, seconds) per job, choosing each job's arm with ``choose(out_or_None)``."""
    timings = []
    last = None
    for req in reqs:
        decision: Decision = choose(last)
        start = time.perf_counter()
        out = gen.generate(req, num_draft_tokens=decision.k or None, use_draft=decision.speculative)
        timings.append((out.completion_tokens, time.perf_counter() - start))
        last = (decision, out)
    return timings


def rate(timings: list[tuple[int, float]]) -> float:
    return sum(t for t, _ in timings) / sum(s for _, s in timings)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=32)
    args = ap.parse_args()
    target = model("wide")
    pairs = {
        "copy (synthetic)": (model("copy"), (2, 4, 6, 8)),
        "unrelated (synthetic)": (model("unrelated"), (1, 2)),
    }
    cache = ModelCache()
    report: dict = {
        "target": target,
        "jobs": args.jobs,
        "max_tokens": args.max_tokens,
        "arms_explored_by_auto": 1 + len(DEFAULT_KS),
        "pairs": {},
    }
    for name, (draft, fixed_ks) in pairs.items():
        gen = ChatGenerator.get_or_create(target, draft, cache=cache)
        reqs = jobs(target, draft, args.jobs, args.max_tokens)
        gen.generate(reqs[0], use_draft=False)  # warm up
        fixed = {}
        for k in (PLAIN, *fixed_ks):
            fixed[k] = run(gen, reqs, lambda _, k=k: Decision(k, "fixed"))
        policy = SpeculationPolicy("auto")

        def choose(last, policy=policy, draft=draft):
            if last is not None:
                policy.record(target, draft, *last)
            return policy.choose(target, draft)

        auto = run(gen, reqs, choose)  # from scratch: includes its exploring
        warm = run(gen, reqs, choose)  # the same jobs again, policy already measured
        best_k = max(fixed, key=lambda k: rate(fixed[k]))
        row = {
            "tok_s": {
                ("plain" if k == PLAIN else f"k={k}"): round(rate(v), 2) for k, v in fixed.items()
            }
            | {"auto": round(rate(auto), 2)},
            "best_fixed": "plain" if best_k == PLAIN else f"k={best_k}",
            "auto_warm_tok_s": round(rate(warm), 2),
            "auto_cold_over_best_fixed": round(rate(auto) / rate(fixed[best_k]), 3),
            "auto_warm_over_best_fixed": round(rate(warm) / rate(fixed[best_k]), 3),
            "auto_warm_over_plain": round(rate(warm) / rate(fixed[PLAIN]), 3),
            "auto_choices": policy.summary(),
        }
        report["pairs"][name] = row
        print(name, json.dumps(row), flush=True)
    OUT.mkdir(exist_ok=True)
    (OUT / "policy.json").write_text(json.dumps(report, indent=1))
    names = list(report["pairs"])
    grouped_bars(
        OUT / "policy.png",
        "Speculation policy: auto vs plain vs best fixed k",
        names,
        {
            "plain": [report["pairs"][n]["tok_s"]["plain"] for n in names],
            "best fixed": [
                report["pairs"][n]["tok_s"][report["pairs"][n]["best_fixed"]] for n in names
            ],
            "auto": [report["pairs"][n]["tok_s"]["auto"] for n in names],
        },
        "tokens/s",
    )


if __name__ == "__main__":
    main()
