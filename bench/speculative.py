"""Speculative decoding: acceptance, speedup, and speedup predicted from measured costs.

For each (target, draft) pair and each k = num_draft_tokens, runs the same
greedy prompts through mlxq's engine (mlx-lm's speculative decoding) and
reports acceptance (accepted / proposed), tokens/s, speedup over plain
decoding, and the speedup predicted from the measured acceptance and the
measured costs of one draft step and of verifying k + 1 tokens:

    predicted = tokens_per_round / (k * t_draft / t_step + t_verify(k + 1) / t_step)

where t_step is one 1-token forward pass of the target, t_verify(k + 1) a
(k + 1)-token pass (measured alternating with t_step, so noise hits both
alike) and tokens_per_round = generated / rounds is the measured acceptance.
The model leaves out per-round Python work (sampling, syncing, cache
rewinds), so it overestimates most at large k. Each speedup is taken against a
plain run made right before it.

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
from worker.cache import ModelCache
from worker.generator import ChatGenerator

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


def run(gen: ChatGenerator, target: str, draft: str | None, k: int, max_tokens: int) -> dict:
    tokens = accepted = proposed = 0
    outputs = []
    start = time.perf_counter()
    for prompt in PROMPTS:
        body = {
            "model": target,
            "temperature": 0,
            "max_tokens": max_tokens,
            "messages": [{"role": "user", "content": prompt}],
        }
        if draft:
            body |= {"draft_model": draft, "num_draft_tokens": k}
        out = gen.generate(ChatRequest.model_validate(body))
        tokens += out.completion_tokens
        accepted += out.draft_tokens_accepted
        proposed += out.draft_tokens_proposed
        outputs.append(out.token_ids)
    elapsed = time.perf_counter() - start
    rounds = tokens - accepted  # each round ends with one token of the target's own
    return {
        "tokens": tokens,
        "seconds": elapsed,
        "tok_s": tokens / elapsed,
        "accepted": accepted,
        "proposed": proposed,
        "rounds": rounds,
        "outputs": outputs,
    }


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
    ap.add_argument("--ks", default="1-8")
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args()
    target = args.target or model("wide")
    drafts = dict(d.split("=", 1) for d in args.draft) or {
        "copy (synthetic)": model("copy"),
        "unrelated (synthetic)": model("unrelated"),
    }
    cache = ModelCache()
    plain_gen = ChatGenerator.get_or_create(target, cache=cache)
    run(plain_gen, target, None, 0, 4)  # warm up
    t_plain, _, _ = cost_ratio(plain_gen.target.model, 1)
    report: dict = {
        "target": target,
        "synthetic": args.target is None,
        "prompts": len(PROMPTS),
        "max_tokens": args.max_tokens,
        "t_plain_step_ms": round(t_plain * 1e3, 2),
        "pairs": {},
    }
    plain_outputs = None
    for name, draft in drafts.items():
        gen = ChatGenerator.get_or_create(target, draft, cache=cache)
        t_draft, _, _ = cost_ratio(gen.draft.model, 1)
        rows = []
        for k in parse_ks(args.ks):
            # Plain and speculative runs back to back: the speedup is a same-moment ratio.
            plain = run(plain_gen, target, None, 0, args.max_tokens)
            plain_outputs = plain_outputs or plain["outputs"]
            r = run(gen, target, draft, k, args.max_tokens)
            t_verify, verify_over_step, t_step = cost_ratio(gen.target.model, k + 1)
            per_round = r["tokens"] / max(r["rounds"], 1)
            predicted = per_round / (k * t_draft / t_step + verify_over_step)
            speedup = r["tok_s"] / plain["tok_s"]
            row = {
                "k": k,
                "acceptance": round(r["accepted"] / r["proposed"], 3) if r["proposed"] else None,
                "tokens_per_round": round(per_round, 3),
                "plain_tok_s": round(plain["tok_s"], 2),
                "tok_s": round(r["tok_s"], 2),
                "speedup": round(speedup, 3),
                "predicted_speedup": round(predicted, 3),
                "measured_over_predicted": round(speedup / predicted, 3),
                "t_draft_step_ms": round(t_draft * 1e3, 2),
                "t_verify_ms": round(t_verify * 1e3, 2),
                "t_step_ms": round(t_step * 1e3, 2),
                "greedy_equal_to_plain": r["outputs"] == plain_outputs == plain["outputs"],
            }
            rows.append(row)
            print(name, row, flush=True)
        report["pairs"][name] = {"draft": draft, "rows": rows}
    OUT.mkdir(exist_ok=True)
    (OUT / "speculative.json").write_text(json.dumps(report, indent=1))
    plot(report, OUT / "speculative.png")
    if not all(r["greedy_equal_to_plain"] for p in report["pairs"].values() for r in p["rows"]):
        raise SystemExit("speculative greedy output differs from plain output")


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
    title = "synthetic models" if report["synthetic"] else report["target"]
    ax.set_title(f"Speculative decoding, {title}, greedy, CPU")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
