"""Speculation policy: auto against fixed choices, per (target, draft) pair, same jobs.

Runs N greedy jobs with ``--speculative auto`` from a fresh policy (cold: it
spends its first jobs measuring), then the same jobs again with the policy
warm, each job also run by plain decoding and every fixed draft length right
next to auto's run (noise hits all arms alike), and reports auto's throughput
against the best fixed choice. Synthetic models (bench/fixtures.py).

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
from worker.engine.generator import ChatGenerator
from worker.engine.models import ModelCache
from worker.engine.output import GenerationOutput
from worker.runner.alone import speed_of
from worker.schedule.policy import DEFAULT_KS, PLAIN, Decision, SpeculationPolicy

OUT = Path(__file__).parent / "out"


def jobs(
    target: str, draft: str, n: int, max_tokens: int, contents: list[str] | None = None
) -> list[ChatRequest]:
    contents = contents or [f"Job {i}: tell me about queues." for i in range(n)]
    return [
        ChatRequest.model_validate(
            {
                "model": target,
                "draft_model": draft,
                "temperature": 0,
                "max_tokens": max_tokens,
                "messages": [{"role": "user", "content": contents[i % len(contents)]}],
            }
        )
        for i in range(n)
    ]


def one(
    gen: ChatGenerator, req: ChatRequest, decision: Decision
) -> tuple[int, float, GenerationOutput]:
    """(tokens, seconds, output) of one job run as ``decision`` says."""
    start = time.perf_counter()
    out = gen.generate(
        req,
        num_draft_tokens=decision.k or None,
        use_draft=decision.speculative,
        give_up_below=decision.give_up_below,
    )
    return out.completion_tokens, time.perf_counter() - start, out


def run(
    gen: ChatGenerator, reqs: list[ChatRequest], choose
) -> tuple[list[tuple[int, float]], list[tuple[int, float]], list[tuple[Decision, bool]]]:
    """(tokens, seconds) per job, choosing each job's arm with ``choose(out_or_None)``;
    of the same job decoded plainly right after it (noise hits both alike); and each
    job's decision and whether it gave up speculating."""
    timings, plain, arms = [], [], []
    last = None
    for req in reqs:
        decision: Decision = choose(last)
        tokens, seconds, out = one(gen, req, decision)
        timings.append((tokens, seconds))
        plain.append(one(gen, req, Decision(PLAIN, "plain"))[:2])
        last = (decision, speed_of(out))
        arms.append((decision, bool(out.gave_up_after)))
    return timings, plain, arms


def rate(timings: list[tuple[int, float]]) -> float:
    return sum(t for t, _ in timings) / sum(s for _, s in timings)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument(
        "--trained",
        action="store_true",
        help="also the pair trained on CPython sources (bench/trained.py; ~10 min once)",
    )
    ap.add_argument(
        "--eagle3",
        action="store_true",
        help="also the trained target with its EAGLE-3 drafter (bench/eagle.py; trained once)",
    )
    ap.add_argument("--pairs", default="copy,unrelated", help="of: copy, unrelated")
    args = ap.parse_args()
    wide = model("wide")
    pairs: dict[str, tuple[str, str, tuple[int, ...], list[str] | None]] = {
        "copy (synthetic)": (wide, model("copy"), (2, 4, 6, 8), None),
        "unrelated (synthetic)": (wide, model("unrelated"), (1, 2), None),
    }
    pairs = {n: v for n, v in pairs.items() if n.split()[0] in args.pairs.split(",")}
    if args.trained:
        from bench.trained import ensure_pair, prompts

        t, d = ensure_pair()
        pairs["cpython (trained)"] = (t, d, (1, 2, 3, 4), prompts(args.jobs))
    if args.eagle3:
        from bench.eagle import ensure_drafter
        from bench.trained import ensure_pair, prompts

        t, _ = ensure_pair()
        eagle = ensure_drafter(t, 400, 64)
        pairs["cpython + EAGLE-3 (trained)"] = (t, eagle, (1, 2, 3), prompts(args.jobs))
    cache = ModelCache()
    report: dict = {
        "jobs": args.jobs,
        "max_tokens": args.max_tokens,
        "arms_explored_by_auto": 1 + len(DEFAULT_KS),
        "pairs": {},
    }
    for name, (target, draft, fixed_ks, contents) in pairs.items():
        gen = ChatGenerator.get_or_create(target, draft, cache=cache)
        reqs = jobs(target, draft, args.jobs, args.max_tokens, contents)
        gen.generate(reqs[0], use_draft=False)  # warm up
        policy = SpeculationPolicy("auto")

        def choose(last, policy=policy, target=target, draft=draft):
            if last is not None:
                policy.record(target, draft, *last)
            return policy.choose(target, draft)

        auto, cold_plain, arms = run(gen, reqs, choose)  # from scratch: with its exploring
        # Warm: the same jobs again, each run by auto (policy already measured) and
        # by every fixed arm back to back, so machine noise hits all of them alike.
        fixed: dict[int, list[tuple[int, float]]] = {k: [] for k in (PLAIN, *fixed_ks)}
        warm, last = [], None
        for req in reqs:
            for k in fixed:
                fixed[k].append(one(gen, req, Decision(k, "fixed"))[:2])
            decision = choose(last)
            tokens, seconds, out = one(gen, req, decision)
            warm.append((tokens, seconds))
            last = (decision, speed_of(out))
        best_k = max(fixed, key=lambda k: rate(fixed[k]))
        row = {
            "target": target,
            "tok_s": {
                ("plain" if k == PLAIN else f"k={k}"): round(rate(v), 2) for k, v in fixed.items()
            }
            | {"auto": round(rate(auto), 2)},
            "best_fixed": "plain" if best_k == PLAIN else f"k={best_k}",
            "auto_warm_tok_s": round(rate(warm), 2),
            "auto_cold_over_best_fixed": round(rate(auto) / rate(fixed[best_k]), 3),
            "auto_cold_over_plain_beside_it": round(rate(auto) / rate(cold_plain), 3),
            "auto_cold_arms": [
                ("plain" if d.k == PLAIN else f"k={d.k}") + (" (gave up)" if g else "")
                for d, g in arms
            ],
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
