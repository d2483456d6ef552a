"""EAGLE-3 and DFlash against plain decoding, a draft model and prompt lookup, by batch size.

The target is ``bench.trained``'s 4 x 256 llama trained on the CPython standard
library (its 1 x 128 draft is the draft-model arm). Two drafters for it are trained
here (``bench.drafters``) on the target's own greedy continuations of training-split
file openings and cached beside the pair: an EAGLE-3 head (one layer of 256 reading
three of its layers, ``--steps``) and a DFlash drafter (two layers of 256 reading the
same three, whole blocks, ``--dflash-steps``). Every arm then decodes the openings of
held-out files (never trained on by any model), greedy, engine-level as
``bench.specbatch`` (no Redis; tokens/s while all B rows decode, after the first
round): plain, draft k, lookup k, eagle3 at each k of ``--ks``, dflash at each k of
``--dflash-ks``, and each drafter adaptive (each round's k from the measured goodput,
0 = a plain step: what ``--speculative auto`` runs once it picks a speculative batch).
Every arm's text is checked against plain.

Printed per batch size: tokens/s, tokens per row per round (E) and each arm over plain;
each adaptive arm over the best fixed arm (goal >= 0.95). Then a prediction for an M4
Mac mini (``--gpu-gbps``, ``--gpu-tflops``) serving an 8B target at 4 bits (4.5 GB,
``--predict-gb``) with a 0.25B-parameter EAGLE-3 head and a ~1.2B-parameter DFlash
drafter (five layers of 4,096 and ``fc``, as z-lab's default config) at 16 bits: each
pass costs the larger of reading its weights and its arithmetic, a round is the target's
verify pass and k EAGLE-3 passes or one DFlash pass over the block, with the E measured
here for each k and batch size (and, for DFlash, once more with
``--published-dflash-e``, about the tokens per round that z-lab's reported up-to-6x
speedups on Qwen3-8B imply at blocks of 16, since the one trained here is not trained
enough to say); host time is left out (for plain and speculative alike). A prediction,
not a measurement.

    bench/run bench.eagle [--batches 1,4,8,16] [--ks 1,2,3] [--dflash-ks 3,6] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

from bench import trained
from bench.drafters import train_dflash, train_eagle3
from bench.specbatch import acceptance, throughput
from schemas import ChatRequest
from worker.dev.tinydrafters import write_dflash, write_eagle3
from worker.engine import prompt_tokens
from worker.engine.batch import BatchEngine
from worker.engine.generator import ChatGenerator
from worker.engine.models import ModelCache
from worker.engine.specbatch import SpecBatchEngine
from worker.schedule.goodput import Goodput

OUT = Path(__file__).parent / "out"
#: The DFlash drafter's training steps (whole blocks from states alone learn slower
#: than a head's one step ahead).
DFLASH_STEPS = 1000


def ensure_drafter(target: str, steps: int, prompts: int, kind: str = "eagle3") -> str:
    """The drafter of ``kind`` (eagle3, dflash) for ``target``, trained once (``steps``
    over ``prompts`` training-split openings) and cached beside it."""
    path = Path(target).parent / f"cpython-{kind}-{steps}x{prompts}"
    if (path / "mlxq-trained.json").exists():
        return str(path)
    gen = ChatGenerator.get_or_create(target, cache=ModelCache(prefix_bytes=0))
    texts = trained.openings(trained.sources()[0], prompts)
    tokens = [prompt_tokens(gen.target.tokenizer, _request(target, t, 1)) for t in texts]
    began = time.perf_counter()
    if kind == "dflash":  # (two anchors per opening a step: 128 blocks)
        write_dflash(path, target, seed=0)
        losses = train_dflash(path, Path(target), tokens, steps=steps, new=64, anchors=2)
    else:
        write_eagle3(path, target, seed=0)
        losses = train_eagle3(path, Path(target), tokens, steps=steps, new=64)
    losses["seconds"] = time.perf_counter() - began
    print(f"trained {path.name}: {losses}", flush=True)
    (path / "mlxq-trained.json").write_text(json.dumps(losses))
    return str(path)


def _request(target: str, text: str, tokens: int) -> ChatRequest:
    return ChatRequest.model_validate(
        {
            "model": target,
            "messages": [{"role": "user", "content": text}],
            "max_tokens": tokens,
            "temperature": 0,
        }
    )


def _engine(arm: str, gens: dict[str, ChatGenerator], b: int) -> Any:
    """The engine for ``arm``: "plain", "<kind> k", or "<kind> adaptive a-b-c"."""
    kind, _, k = arm.partition(" ")
    gen = gens[kind]
    if kind == "plain":
        return BatchEngine(gen.target, b)
    if k.startswith("adaptive"):
        most = max(int(x) for x in k.split()[1].split("-"))
        return SpecBatchEngine(gen.target, None, most, Goodput(most), drafter=gen.drafter)
    return SpecBatchEngine(gen.target, gen.draft, int(k), drafter=gen.drafter)


def _texts(engine: Any, gen: ChatGenerator, reqs: list[ChatRequest]) -> list[list[int]]:
    """Each request's greedy tokens through ``engine`` (all added at once)."""
    from worker.engine import Prepared, params_for

    for i, r in enumerate(reqs):
        prompt = prompt_tokens(gen.target.tokenizer, r)
        engine.add(i, Prepared(prompt, params_for(r, len(prompt), 4096, 512, 3)))
    outs: dict = {}
    while len(engine):
        outs.update(engine.step().done)
    return [outs[i].token_ids for i in range(len(reqs))]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,4,8,16")
    ap.add_argument("--ks", default="1,2,3")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=2, help="every cell once per round")
    ap.add_argument("--steps", type=int, default=400, help="the EAGLE-3 head's training steps")
    ap.add_argument("--dflash-ks", default="3,6")
    ap.add_argument("--dflash-steps", type=int, default=DFLASH_STEPS)
    ap.add_argument("--train-prompts", type=int, default=64)
    ap.add_argument("--gpu-gbps", type=float, default=120.0)
    ap.add_argument("--gpu-tflops", type=float, default=4.0)
    ap.add_argument("--predict-gb", type=float, default=4.5, help="the predicted target's weights")
    ap.add_argument("--predict-params", type=float, default=8e9)
    ap.add_argument("--predict-head-params", type=float, default=0.25e9)
    ap.add_argument("--predict-dflash-params", type=float, default=1.2e9)
    ap.add_argument(
        "--published-dflash-e",
        type=float,
        default=6.5,
        help="a trained DFlash's tokens per round at blocks of 16 (about what z-lab's 6x implies)",
    )
    args = ap.parse_args()
    target, draft = trained.ensure_pair()
    eagle = ensure_drafter(target, args.steps, args.train_prompts)
    dflash = ensure_drafter(target, args.dflash_steps, args.train_prompts, "dflash")
    cache = ModelCache(prefix_bytes=0)
    gens = {
        "plain": ChatGenerator.get_or_create(target, cache=cache),
        "draft": ChatGenerator.get_or_create(target, draft, cache=cache),
        "eagle3": ChatGenerator.get_or_create(target, eagle, cache=cache),
        "dflash": ChatGenerator.get_or_create(target, dflash, cache=cache),
    }
    gens["lookup"] = gens["plain"]
    batches = [int(b) for b in args.batches.split(",")]
    ks = [int(k) for k in args.ks.split(",")]
    dks = [int(k) for k in args.dflash_ks.split(",")]
    kmax = max(ks)
    arms = ["plain", f"draft {kmax}", f"lookup {kmax}"]
    arms += [f"eagle3 {k}" for k in ks] + [f"eagle3 adaptive {'-'.join(map(str, ks))}"]
    arms += [f"dflash {k}" for k in dks] + [f"dflash adaptive {'-'.join(map(str, dks))}"]
    held = trained.prompts(max(batches))
    lookup = {"method": "prompt_lookup", "num_tokens": kmax}

    def reqs(arm: str, b: int) -> list[ChatRequest]:
        rs = [_request(target, t, args.tokens) for t in held[:b]]
        if arm.startswith("lookup"):
            rs = [
                ChatRequest.model_validate(
                    r.model_dump(exclude_none=True) | {"speculation": lookup}
                )
                for r in rs
            ]
        return rs

    # Exactness first: every arm's greedy tokens are plain's (largest batch).
    b = max(batches)
    want = _texts(_engine("plain", gens, b), gens["plain"], reqs("plain", b))
    for arm in arms[1:]:
        got = _texts(_engine(arm, gens, b), gens["plain"], reqs(arm, b))
        same = sum(g == w for g, w in zip(got, want, strict=True))
        print(f"{arm}: {same}/{b} texts equal to plain", flush=True)
    cells: dict[tuple[int, str], list[tuple[float, float]]] = {}
    for rnd in range(args.rounds):
        for b in batches:
            for arm in arms:
                target_model = gens["plain"].target
                rate, e = throughput(_engine(arm, gens, b), target_model, reqs(arm, b))
                cells.setdefault((b, arm), []).append((rate, e))
                print(f"round {rnd + 1} B={b} {arm}: {rate:.1f} tok/s, E {e:.2f}", flush=True)
    report = _report(cells, batches, arms, gens, args)
    OUT.mkdir(exist_ok=True)
    (OUT / "eagle.json").write_text(json.dumps(report, indent=1))


def _report(
    cells: dict, batches: list[int], arms: list[str], gens: dict, args: argparse.Namespace
) -> dict:
    """Medians per cell, ratios over plain, adaptive over the best fixed arm, and the
    M4 prediction."""
    med = {
        c: (statistics.median(r for r, _ in v), statistics.median(e for _, e in v))
        for c, v in cells.items()
    }
    bw, flops = args.gpu_gbps * 1e9, args.gpu_tflops * 1e12

    def target_pass(tokens: int) -> float:
        return max(args.predict_gb * 1e9 / bw, 2 * args.predict_params * tokens / flops)

    def head_pass(params: float, tokens: int) -> float:
        return max(params * 2 / bw, 2 * params * tokens / flops)

    adaptives = [a for a in arms if " adaptive " in a]
    rows = []
    print("\nB    " + "  ".join(f"{a:>14}" for a in arms) + "   adaptive/best fixed")
    for b in batches:
        plain = med[(b, "plain")][0]
        fixed = max(med[(b, a)][0] for a in arms if a not in adaptives)
        over = {a: med[(b, a)][0] / fixed for a in adaptives}
        cols = "  ".join(f"{med[(b, a)][0]:7.1f} {med[(b, a)][0] / plain:5.2f}x" for a in arms)
        print(f"{b:<4} {cols}   " + " ".join(f"{v:.3f}" for v in over.values()))
        predicted = {"plain": b / target_pass(b)}
        for a in arms:
            kind, k = a.split()[0], a.split()[-1]
            if kind in ("eagle3", "dflash") and k.isdigit():
                e, k_ = med[(b, a)][1], int(k)
                if kind == "eagle3":
                    draft_s = k_ * head_pass(args.predict_head_params, b)
                else:  # one pass over each row's block
                    draft_s = head_pass(args.predict_dflash_params, b * (k_ + 1))
                predicted[a] = b * e / (target_pass(b * (k_ + 1)) + draft_s)
        # (a trained DFlash drafter's published E: tokens per round at its block of 16)
        paper = target_pass(b * 16) + head_pass(args.predict_dflash_params, b * 16)
        predicted["dflash 15, published E"] = b * args.published_dflash_e / paper
        rows.append(
            {
                "batch": b,
                "tok_s": {a: med[(b, a)][0] for a in arms},
                "tokens_per_round": {a: med[(b, a)][1] for a in arms},
                "acceptance": {
                    a: acceptance(med[(b, a)][1], int(a.split()[1]))
                    for a in arms
                    if a.split()[0] != "plain" and a.split()[1].isdigit()
                },
                "adaptive_over_best_fixed": over,
                "m4_prediction_tok_s": predicted,
            }
        )
    print("\nPredicted on an M4 Mac mini, 8B target at 4 bits (tokens/s; host time left out):")
    for r in rows:
        pred = r["m4_prediction_tok_s"]
        print(f"B={r['batch']}: " + ", ".join(f"{a} {v:.0f}" for a, v in pred.items()))
    return {
        "args": vars(args),
        "rows": rows,
        "cells": {f"{b} {a}": v for (b, a), v in cells.items()},
    }


if __name__ == "__main__":
    main()
