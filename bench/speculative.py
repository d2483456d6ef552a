"""Speculative decoding: acceptance, speedup, and speedup predicted from measured costs.

For each (target, draft) pair and each k = num_draft_tokens, runs the same
greedy prompts through mlxq's engine (its speculative loop, worker.engine.speculate) and
reports acceptance (accepted / proposed), tokens/s, speedup over plain
decoding, and the speedup predicted from the measured acceptance and the
measured costs of one draft step and of verifying k + 1 tokens:

    predicted = (P + N) / (P + R * (k * t_draft / t_step + t_verify(k + 1) / t_step))

per prompt, where t_step is one 1-token forward pass of the target,
t_verify(k + 1) a (k + 1)-token pass (measured alternating with t_step, so noise
hits both alike), N the tokens generated, R the rounds (N - accepted: the
measured acceptance) and P the prompt's prefill in plain decode steps (measured
on the plain run). Prefill is paid once by both runs, so it weighs more on the
faster one: leaving it out overestimated k=8 by ~25%. The model still leaves out
per-round Python work (sampling, syncing, cache rewinds). Each prompt runs
plain and speculative back to back; speedup and measured/predicted are
medians over those pairs.

Every speculative output is checked equal to the plain greedy output.

    .venv/bin/python -m bench.speculative [--target T --draft NAME=PATH ...] [--ks 1-8]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

from bench.fixtures import model
from bench.plots import pyplot
from schemas import ChatRequest
from worker.engine.generator import ChatGenerator
from worker.engine.models import ModelCache

OUT = Path(__file__).parent / "out"
PROMPTS = [
    "Tell me about job queues.",
    "Write a short note on speculative decoding.",
    "List three things a Mac mini fleet needs.",
]


def _forward_seconds(net: nn.Module, cache: list, n: int) -> float:
    x = mx.full((1, n), 9)
    start = time.perf_counter()
    mx.eval(net(x, cache=cache))
    elapsed = time.perf_counter() - start
    trim_prompt_cache(cache, n)
    return elapsed


def cost_ratio(
    net: nn.Module, n: int, context: int = 64, reps: int = 15
) -> tuple[float, float, float]:
    """Median seconds of an ``n``-token pass, median ratio to a 1-token pass, median 1-token.

    The n-token and 1-token passes alternate, so machine noise hits both alike.
    """
    cache = make_prompt_cache(net)
    mx.eval(net(mx.arange(context)[None] % 256 + 7, cache=cache))
    for _ in range(2):
        _forward_seconds(net, cache, n)
        _forward_seconds(net, cache, 1)
    pairs = [
        (_forward_seconds(net, cache, n), _forward_seconds(net, cache, 1)) for _ in range(reps)
    ]
    return (
        statistics.median(a for a, _ in pairs),
        statistics.median(a / b for a, b in pairs),
        statistics.median(b for _, b in pairs),
    )


def generate(gen: ChatGenerator, target: str, draft: str | None, k: int, prompt: str, n: int):
    body = {
        "model": target,
        "temperature": 0,
        "max_tokens": n,
        "messages": [{"role": "user", "content": prompt}],
    }
    if draft:
        body |= {"draft_model": draft, "num_draft_tokens": k}
    start = time.perf_counter()
    out = gen.generate(ChatRequest.model_validate(body))
    return out, time.perf_counter() - start


def paired(
    plain_gen: ChatGenerator,
    gen: ChatGenerator,
    target: str,
    draft: str,
    k: int,
    max_tokens: int,
    reps: int,
    prompts: list[str] = PROMPTS,
) -> dict:
    """Plain and speculative runs of each prompt back to back, ``reps`` times.

    The speedup is the median of the per-pair time ratios: each pair ran at
    nearly the same moment, so machine noise cancels instead of landing on one
    side (plain runs minutes apart differed by 30% on a shared 2-core host).
    """
    tokens = accepted = proposed = 0
    plain_s = spec_s = 0.0
    pairs, equal = [], True
    for _ in range(reps):
        for prompt in prompts:
            p_out, p_s = generate(plain_gen, target, None, 0, prompt, max_tokens)
            s_out, s_s = generate(gen, target, draft, k, prompt, max_tokens)
            equal &= p_out.token_ids == s_out.token_ids
            n = s_out.completion_tokens
            # The prompt's prefill, in units of this plain run's own decode step.
            step = (p_s - p_out.time_to_first_token_s) / max(p_out.completion_tokens - 1, 1)
            pairs.append(
                {
                    "ratio": (p_s / p_out.completion_tokens) / (s_s / n),
                    "tokens": n,
                    "rounds": n - s_out.draft_tokens_accepted,
                    "prefill_steps": p_out.time_to_first_token_s / step,
                }
            )
            tokens += n
            accepted += s_out.draft_tokens_accepted
            proposed += s_out.draft_tokens_proposed
            plain_s, spec_s = plain_s + p_s, spec_s + s_s
    return {
        "tokens": tokens,
        "plain_tok_s": tokens / plain_s,
        "tok_s": tokens / spec_s,
        "speedup": statistics.median(p["ratio"] for p in pairs),
        "accepted": accepted,
        "proposed": proposed,
        "rounds": tokens - accepted,  # each round ends with one token of the target's own
        "pairs": pairs,
        "equal": equal,
    }


def predict(pair: dict, k: int, draft_over_step: float, verify_over_step: float) -> float:
    """The pair's speedup from its measured prefill, tokens and rounds and the pass costs."""
    prefill, tokens, rounds = pair["prefill_steps"], pair["tokens"], pair["rounds"]
    return (prefill + tokens) / (prefill + rounds * (k * draft_over_step + verify_over_step))


def parse_ks(text: str) -> list[int]:
    if "-" in text:
        lo, hi = text.split("-")
        return list(range(int(lo), int(hi) + 1))
    return [int(x) for x in text.split(",")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", help="hub id or path [default: synthetic 'wide']")
    ap.add_argument(
        "--draft",
        action="append",
        default=[],
        help="NAME=PATH_OR_HUB_ID (repeatable) [default: synthetic copy, unrelated]",
    )
    ap.add_argument(
        "--trained",
        action="store_true",
        help="also the pair trained on CPython sources (bench/trained.py; ~10 min once)",
    )
    ap.add_argument("--ks", default="1-8")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=2, help="passes over the prompts per k")
    args = ap.parse_args()
    # (target, {name: draft}, prompts) groups
    groups = [
        (
            args.target or model("wide"),
            dict(d.split("=", 1) for d in args.draft)
            or {"copy (synthetic)": model("copy"), "unrelated (synthetic)": model("unrelated")},
            PROMPTS,
        )
    ]
    if args.trained:
        from bench.trained import ensure_pair, prompts

        t, d = ensure_pair()
        groups.append((t, {"cpython (trained)": d}, prompts()))
    cache = ModelCache()
    report: dict = {
        "synthetic": args.target is None,
        "reps": args.reps,
        "max_tokens": args.max_tokens,
        "pairs": {},
    }
    for target, drafts, prompts_ in groups:
        plain_gen = ChatGenerator.get_or_create(target, cache=cache)
        generate(plain_gen, target, None, 0, prompts_[0], 4)  # warm up
        for name, draft in drafts.items():
            gen = ChatGenerator.get_or_create(target, draft, cache=cache)
            t_draft, _, _ = cost_ratio(gen.draft.model, 1)
            rows = []
            for k in parse_ks(args.ks):
                r = paired(plain_gen, gen, target, draft, k, args.max_tokens, args.reps, prompts_)
                rows.append(_row(k, r, gen, t_draft))
                print(name, rows[-1], flush=True)
            report["pairs"][name] = {"target": target, "draft": draft, "rows": rows}
    OUT.mkdir(exist_ok=True)
    (OUT / "speculative.json").write_text(json.dumps(report, indent=1))
    plot(report, OUT / "speculative.png")
    if not all(r["greedy_equal_to_plain"] for p in report["pairs"].values() for r in p["rows"]):
        raise SystemExit("speculative greedy output differs from plain output")


def _row(k: int, r: dict, gen: ChatGenerator, t_draft: float) -> dict:
    t_verify, verify_over_step, t_step = cost_ratio(gen.target.model, k + 1)
    each = [predict(p, k, t_draft / t_step, verify_over_step) for p in r["pairs"]]
    fit = statistics.median(x["ratio"] / e for x, e in zip(r["pairs"], each, strict=True))
    return {
        "k": k,
        "acceptance": round(r["accepted"] / r["proposed"], 3) if r["proposed"] else None,
        "tokens_per_round": round(r["tokens"] / max(r["rounds"], 1), 3),
        "plain_tok_s": round(r["plain_tok_s"], 2),
        "tok_s": round(r["tok_s"], 2),
        "speedup": round(r["speedup"], 3),
        "predicted_speedup": round(statistics.median(each), 3),
        "measured_over_predicted": round(fit, 3),
        "prefill_steps": round(statistics.median(x["prefill_steps"] for x in r["pairs"]), 2),
        "t_draft_step_ms": round(t_draft * 1e3, 2),
        "t_verify_ms": round(t_verify * 1e3, 2),
        "t_step_ms": round(t_step * 1e3, 2),
        "greedy_equal_to_plain": r["equal"],
    }


def plot(report: dict, path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, pair in report["pairs"].items():
        ks = [r["k"] for r in pair["rows"]]
        line = ax.plot(ks, [r["speedup"] for r in pair["rows"]], "o-", label=f"{name} measured")
        ax.plot(
            ks,
            [r["predicted_speedup"] for r in pair["rows"]],
            "x--",
            color=line[0].get_color(),
            label=f"{name} predicted",
        )
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xlabel("num_draft_tokens (k)")
    ax.set_ylabel("speedup over plain decoding")
    title = "synthetic and trained models" if report["synthetic"] else "hub models"
    ax.set_title(f"Speculative decoding, {title}, greedy, CPU")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
