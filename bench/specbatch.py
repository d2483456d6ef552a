"""Speculative batches: tokens/s against batch size and k, and the cost model behind it.

For the copy pair (12x1024 target, 1x128 "copy" draft) and batch sizes B, this
measures, engine-level (no Redis: only decoding is timed):

- throughput: B greedy sequences decoded together, plainly (``BatchEngine``, k=0),
  speculatively at each k and adaptively (``SpecBatchEngine``, each round's k
  chosen by ``worker.schedule.goodput`` up to the largest k), tokens/s over the rounds
  after the first, while all B decode;
- step times, measured right after each cell's throughput (this VM's speed
  drifts 2x within minutes, so a prediction is only as good as the times it is
  made of): one target pass over (B, 1) and (B, k+1) tokens, one draft pass over
  (B, 1), with a cache holding the prompt (medians of 5);
- the prediction: B * E / (k * t_draft(B) + t_target(B, k+1) + t_rewind(B, k) +
  c * B * E), with E the measured tokens per row per round, t_rewind the measured
  cost of dropping 0..k rejected positions per row from both caches, and c the
  bookkeeping per emitted token (sampling, detokenizing, stop checks: a plain
  step's wall time minus its target pass, over its B tokens; so the plain column
  is 1.00 by construction); measured / predicted is printed for every cell
  (per round, median over ``--rounds``; every cell runs once per round);
- where the time goes: the target pass as a line in the tokens it processes,
  fixed cost (reading the weights) plus arithmetic per token, and the share of a
  plain step that is arithmetic: speculation trades extra verified tokens for
  fewer weight reads, so it pays as much as a plain step is *not* arithmetic.

It then applies the same model to a memory-bound GPU: a pass costs the larger of
reading the weights (bytes / bandwidth) and its arithmetic (2 x params x tokens /
peak FLOP/s), a rewind reads and writes both models' filled caches once, with
the bandwidth and FLOP/s given (default: an M4 Mac mini, 120 GB/s and 4 TFLOP/s
fp32), the same acceptance and this CPU's bookkeeping per token (host Python;
an M4's cores are faster, so this is on the safe side).

    bench/run bench.specbatch [--batches 1,2,4,8] [--ks 1,2,4,6] [--tokens 48] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.models.cache import KVCache

from bench.fixtures import model
from bench.plots import pyplot
from schemas import ChatRequest
from worker.engine import Prepared, params_for, prompt_tokens
from worker.engine.batch import BatchEngine
from worker.engine.models import ModelCache
from worker.engine.specbatch import SpecBatchEngine
from worker.schedule.goodput import Goodput

OUT = Path(__file__).parent / "out"


def requests(target: str, n: int, tokens: int) -> list[ChatRequest]:
    return [
        ChatRequest.model_validate(
            {
                "model": target,
                "messages": [{"role": "user", "content": f"Job {i}: tell me about queues."}],
                "max_tokens": tokens,
                "temperature": 0,
            }
        )
        for i in range(n)
    ]


def throughput(engine: Any, target: Any, reqs: list[ChatRequest]) -> tuple[float, float]:
    """(tokens/s while every row decodes, after the first round; tokens per row per round)."""
    for i, r in enumerate(reqs):
        prompt = prompt_tokens(target.tokenizer, r)
        engine.add(i, Prepared(prompt, params_for(r, len(prompt), target.context_length, 512)))
    tokens, seconds, rounds, first = 0, 0.0, 0, True
    while len(engine) == len(reqs):
        t = time.perf_counter()
        step = engine.step()
        elapsed = time.perf_counter() - t
        if step.done:
            break
        if first or step.prefilled:
            first = False
            continue
        tokens += step.tokens
        seconds += elapsed
        rounds += 1
    engine.close()
    return tokens / seconds, tokens / max(rounds, 1) / len(reqs)


def pass_seconds(net: Any, batch: int, width: int, context: int, repeats: int = 5) -> float:
    """Median seconds of one forward pass over (batch, width) tokens after ``context``."""
    samples = []
    for _ in range(repeats):
        cache = [KVCache() for _ in net.layers]
        mx.eval(net(mx.full((1, context), 9), cache=cache))
        rows = [c.merge([c] * batch) for c in cache]
        mx.eval(net(mx.full((batch, width), 9), cache=rows))  # grow the buffers first
        for c in rows:
            c.trim(width)
        mx.eval([(c.keys, c.values) for c in rows])
        t = time.perf_counter()
        mx.eval(net(mx.full((batch, width), 9), cache=rows))
        samples.append(time.perf_counter() - t)
    return statistics.median(samples)


def rewind_seconds(net: Any, batch: int, k: int, context: int, repeats: int = 5) -> float:
    """Median seconds of rewinding a verified round: rows drop 0..k positions each."""
    from worker.engine.specbatch import _drop_tail

    samples = []
    for r in range(repeats):
        cache = [KVCache() for _ in net.layers]
        mx.eval(net(mx.full((1, context + k + 1), 9), cache=cache))
        rows = [c.merge([c] * batch) for c in cache]
        mx.eval([(c.keys, c.values) for c in rows])
        tails = [(i + r) % (k + 1) for i in range(batch)]
        t = time.perf_counter()
        _drop_tail(rows, tails)
        mx.eval([(c.keys, c.values) for c in rows])
        samples.append(time.perf_counter() - t)
    return statistics.median(samples)


def kv_bytes(net: Any, batch: int, context: int) -> int:
    """Bytes of the keys and values ``batch`` rows of ``context`` tokens hold."""
    cache = [KVCache() for _ in net.layers]
    mx.eval(net(mx.full((1, 1), 9), cache=cache))
    return sum(c.keys[..., :1, :].nbytes + c.values[..., :1, :].nbytes for c in cache) * (
        batch * context
    )


def param_count(net: Any) -> int:
    return sum(v.size for _, v in tree_flatten(net.parameters()))


def cell(target: Any, draft: Any, b: int, k: int, reqs: list[ChatRequest], context: int) -> dict:
    """One (B, k) cell (k 0: plain; k < 0: adaptive up to -k): its throughput, then at
    once (so the VM's drift is the same) the passes its prediction is made of."""
    if k == 0:
        engine: Any = BatchEngine(target, b)
    else:
        engine = SpecBatchEngine(target, draft, abs(k), Goodput(abs(k)) if k < 0 else None)
    rate, e = throughput(engine, target, reqs)
    out = {"rate": rate, "e": e, "t1": pass_seconds(target.model, b, 1, context)}
    if k > 0:
        out["tv"] = pass_seconds(target.model, b, k + 1, context)
        out["td"] = pass_seconds(draft.model, b, 1, context)
        out["rw"] = rewind_seconds(target.model, b, k, context) + rewind_seconds(
            draft.model, b, k, context
        )
    return out


def acceptance(e: float, k: int) -> float:
    """p such that a round at length k emits e tokens per row: (1 - p^(k+1)) / (1 - p)."""
    lo, hi = 0.0, 0.9999
    for _ in range(50):
        mid = (lo + hi) / 2
        if (1 - mid ** (k + 1)) / (1 - mid) < e:
            lo = mid
        else:
            hi = mid
    return lo


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,2,4,8")
    ap.add_argument("--ks", default="1,2,4,6")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=2, help="every cell once per round")
    ap.add_argument("--gpu-gbps", type=float, default=120.0)
    ap.add_argument("--gpu-tflops", type=float, default=4.0)
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    ks = [int(k) for k in args.ks.split(",")]
    arms = [0, *ks, -max(ks)]  # plain, each k, adaptive up to the largest
    cache = ModelCache()
    target, _ = cache.get(model("wide"))
    draft, _ = cache.get(model("copy"))
    prompt_len = len(prompt_tokens(target.tokenizer, requests(model("wide"), 1, 1)[0]))
    context = prompt_len + args.tokens // 2
    t_params, d_params = param_count(target.model), param_count(draft.model)
    bw, flops = args.gpu_gbps * 1e9, args.gpu_tflops * 1e12

    def gpu_pass(params: int, tokens: int) -> float:
        return max(params * 4 / bw, 2 * params * tokens / flops)

    runs: dict[tuple[int, int], list[dict]] = {(b, k): [] for b in batches for k in arms}
    for r in range(args.rounds):
        for b in batches:
            reqs = requests(model("wide"), b, args.tokens)
            order = arms[r % len(arms) :] + arms[: r % len(arms)]
            got = {k: cell(target, draft, b, k, reqs, context) for k in order}
            # Bookkeeping per emitted token (sampling, detokenizing, stop checks): the
            # plain batch's step time minus its target pass, over its B tokens.
            per_token = max(b / got[0]["rate"] - got[0]["t1"], 0.0) / b
            for k, c in got.items():
                c["per_token"] = per_token
                if k > 0:
                    round_s = k * c["td"] + c["tv"] + c["rw"] + per_token * b * c["e"]
                    c["predicted"] = b * c["e"] / round_s
                    gpu_round = k * gpu_pass(d_params, b) + gpu_pass(t_params, b * (k + 1))
                    # the rewind reads and writes the filled caches of both models once
                    rewind = (
                        2
                        * (kv_bytes(target.model, b, context) + kv_bytes(draft.model, b, context))
                        / bw
                    )
                    c["gpu"] = b * c["e"] / (gpu_round + rewind + per_token * b * c["e"])
                elif k == 0:
                    c["gpu"] = b / (gpu_pass(t_params, b) + per_token * b)
                runs[(b, k)].append(c)
        print(f"round {r + 1}/{args.rounds} done", flush=True)

    def med(b: int, k: int, key: str) -> float:
        return statistics.median(c[key] for c in runs[(b, k)])

    def name(k: int) -> str:
        return "plain" if k == 0 else (f"k={k}" if k > 0 else f"adaptive<={-k}")

    measured = {str(b): {name(k): med(b, k, "rate") for k in arms} for b in batches}
    ratio = {  # measured / predicted, per round, then the median
        str(b): {
            name(k): statistics.median(c["rate"] / c["predicted"] for c in runs[(b, k)]) for k in ks
        }
        for b in batches
    }
    gpu = {str(b): {name(k): med(b, k, "gpu") for k in [0, *ks]} for b in batches}
    steps = {
        str(b): {
            "target n=1": med(b, 0, "t1"),
            **{f"target n={k + 1}": med(b, k, "tv") for k in ks},
            "draft n=1": statistics.median(c["td"] for k in ks for c in runs[(b, k)]),
        }
        for b in batches
    }
    accept = {str(b): {name(k): acceptance(med(b, k, "e"), k) for k in ks} for b in batches}
    print("tokens/s while all B rows decode (median of rounds):")
    for b in batches:
        print(f"  B={b}: " + ", ".join(f"{k} {v:.1f}" for k, v in measured[str(b)].items()))
    print("measured / predicted (per round, median):")
    for b in batches:
        print(f"  B={b}: " + ", ".join(f"{k} {v:.2f}" for k, v in ratio[str(b)].items()))
    print("where the time goes: the target's pass over n tokens, a line in n (per B)")
    roofline: dict[str, dict[str, float]] = {}
    for b in batches:
        pts = [(b * 1, steps[str(b)]["target n=1"])]
        pts += [(b * (k + 1), steps[str(b)][f"target n={k + 1}"]) for k in ks]
        n_mean = sum(n for n, _ in pts) / len(pts)
        t_mean = sum(t for _, t in pts) / len(pts)
        slope = sum((n - n_mean) * (t - t_mean) for n, t in pts) / sum(
            (n - n_mean) ** 2 for n, _ in pts
        )
        base = t_mean - slope * n_mean
        plain = steps[str(b)]["target n=1"]
        roofline[str(b)] = {
            "fixed_ms": base * 1e3,
            "per_token_ms": slope * 1e3,
            "achieved_gflops": 2 * t_params / slope / 1e9 if slope > 0 else float("inf"),
            "plain_step_compute_share": min(slope * b / plain, 1.0),
        }
        x = roofline[str(b)]
        print(
            f"  B={b}: {x['fixed_ms']:.1f} ms + {x['per_token_ms']:.2f} ms per token "
            f"({x['achieved_gflops']:.0f} GFLOP/s); a plain step is "
            f"{100 * x['plain_step_compute_share']:.0f}% arithmetic; acceptance "
            + ", ".join(f"{k} {v:.2f}" for k, v in accept[str(b)].items())
        )
    print("speculative batch (best k) / plain batch: measured here, predicted for the GPU")
    for b in batches:
        m, g = measured[str(b)], gpu[str(b)]
        best_m = max((k for k in m if k != "plain"), key=m.__getitem__)
        best_g = max((k for k in g if k != "plain"), key=g.__getitem__)
        print(
            f"  B={b}: here {best_m} {m[best_m] / m['plain']:.2f}x; "
            f"GPU {best_g} {g[best_g] / g['plain']:.2f}x"
        )
    report = {
        "prompt_tokens": prompt_len,
        "rounds": args.rounds,
        "tokens_per_s": measured,
        "measured_over_predicted": ratio,
        "acceptance": accept,
        "pass_seconds": steps,
        "target_pass_line": roofline,
        "gpu_predicted_tokens_per_s": gpu,
        "gpu": {"GB/s": args.gpu_gbps, "TFLOP/s": args.gpu_tflops},
    }
    OUT.mkdir(exist_ok=True)
    (OUT / "specbatch.json").write_text(json.dumps(report, indent=1))
    plt = pyplot()
    if plt is not None:
        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        for ax, data, title in (
            (axes[0], measured, "measured (this CPU)"),
            (axes[1], gpu, "predicted (memory-bound GPU)"),
        ):
            for k in data[str(batches[0])]:
                ax.plot(batches, [data[str(b)][k] for b in batches], marker="o", label=k)
            ax.set_xlabel("batch size")
            ax.set_ylabel("tokens/s")
            ax.set_title(title)
            ax.legend()
        fig.tight_layout()
        fig.savefig(OUT / "specbatch.png", dpi=110)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
