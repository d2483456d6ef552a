"""Speculative batches: tokens/s against batch size and k, and the cost model behind it.

For the copy pair (12x1024 target, 1x128 "copy" draft) and batch sizes B, this
measures, engine-level (no Redis: only decoding is timed):

- throughput: B greedy sequences decoded together, plainly (``BatchEngine``, k=0)
  and speculatively at each k (``SpecBatchEngine``), tokens/s over the rounds
  after the first, while all B decode;
- step times: one target pass over (B, n) tokens for n = 1 .. k+1 (n = 1 is a
  plain decode step, n = k+1 a verification), one draft pass over (B, 1), each
  with a cache holding the prompt (alternating, medians);
- the prediction: B * E / (k * t_draft(B) + t_target(B, k+1) + t_rewind(B, k) +
  c * B * E), with E the measured tokens per row per round, t_rewind the measured
  cost of dropping 0..k rejected positions per row from both caches, and c the
  bookkeeping per emitted token (sampling, detokenizing, stop checks: a plain
  step's wall time minus its target pass, over its B tokens; so the plain column
  is 1.00 by construction); measured / predicted is printed for every cell.

It then applies the same model to a memory-bound GPU: a pass costs the larger of
reading the weights (bytes / bandwidth) and its arithmetic (2 x params x tokens /
peak FLOP/s), with the bandwidth and FLOP/s given (default: an M4 Mac mini,
120 GB/s and 4 TFLOP/s fp32), the same acceptance and the same bookkeeping.

    bench/run bench.specbatch [--batches 1,2,4,8] [--ks 1,2,4,6] [--tokens 48]
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
from worker.batching import BatchEngine
from worker.cache import ModelCache
from worker.engine import params_for, prompt_tokens
from worker.specbatch import SpecBatchEngine

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
        engine.add(i, prompt, params_for(r, len(prompt), target.context_length, 512))
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
    from worker.specbatch import _drop_tail

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


def param_count(net: Any) -> int:
    return sum(v.size for _, v in tree_flatten(net.parameters()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,2,4,8")
    ap.add_argument("--ks", default="1,2,4,6")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--gpu-gbps", type=float, default=120.0)
    ap.add_argument("--gpu-tflops", type=float, default=4.0)
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    ks = [int(k) for k in args.ks.split(",")]
    cache = ModelCache()
    target, _ = cache.get(model("wide"))
    draft, _ = cache.get(model("copy"))
    prompt_len = len(prompt_tokens(target.tokenizer, requests(model("wide"), 1, 1)[0]))
    measured: dict[str, dict[str, float]] = {}
    per_round: dict[str, dict[str, float]] = {}
    for b in batches:
        reqs = requests(model("wide"), b, args.tokens)
        rate, _ = throughput(BatchEngine(target, b), target, reqs)
        measured[str(b)] = {"0": rate}
        per_round[str(b)] = {"0": 1.0}
        for k in ks:
            rate, e = throughput(SpecBatchEngine(target, draft, k), target, reqs)
            measured[str(b)][str(k)] = rate
            per_round[str(b)][str(k)] = e
        print(f"B={b}: " + ", ".join(f"k={k} {v:.1f}" for k, v in measured[str(b)].items()))
    steps: dict[str, dict[str, float]] = {}
    for b in batches:
        row = {
            f"target n={n}": pass_seconds(target.model, b, n, prompt_len)
            for n in range(1, max(ks) + 2)
        }
        row["draft n=1"] = pass_seconds(draft.model, b, 1, prompt_len)
        context = prompt_len + args.tokens // 2
        for k in ks:
            row[f"rewind k={k}"] = rewind_seconds(target.model, b, k, context) + rewind_seconds(
                draft.model, b, k, context
            )
        steps[str(b)] = row
    predicted: dict[str, dict[str, float]] = {}
    gpu: dict[str, dict[str, float]] = {}
    t_params, d_params = param_count(target.model), param_count(draft.model)
    bw, flops = args.gpu_gbps * 1e9, args.gpu_tflops * 1e12

    def gpu_pass(params: int, tokens: int) -> float:
        return max(params * 4 / bw, 2 * params * tokens / flops)

    for b in batches:
        s = steps[str(b)]
        # Bookkeeping per emitted token (sampling, detokenizing, stop checks), from the
        # plain batch: its step's wall time minus its target pass, over its B tokens.
        plain_step = b / measured[str(b)]["0"]
        per_token = max(plain_step - s["target n=1"], 0.0) / b
        predicted[str(b)] = {"0": b / (s["target n=1"] + per_token * b)}
        gpu[str(b)] = {"0": b / (gpu_pass(t_params, b) + per_token * b)}
        for k in ks:
            e = per_round[str(b)][str(k)]
            rest = s[f"rewind k={k}"] + per_token * b * e
            round_s = k * s["draft n=1"] + s[f"target n={k + 1}"] + rest
            predicted[str(b)][str(k)] = b * e / round_s
            gpu_round = k * gpu_pass(d_params, b) + gpu_pass(t_params, b * (k + 1)) + rest
            gpu[str(b)][str(k)] = b * e / gpu_round
    print("measured / predicted:")
    for b in batches:
        cells = {k: measured[str(b)][k] / predicted[str(b)][k] for k in measured[str(b)]}
        print(f"  B={b}: " + ", ".join(f"k={k} {v:.2f}" for k, v in cells.items()))
    print("speculative batch (best k) / plain batch: measured here, predicted for the GPU")
    for b in batches:
        m, g = measured[str(b)], gpu[str(b)]
        best_m = max((k for k in m if k != "0"), key=m.__getitem__)
        best_g = max((k for k in g if k != "0"), key=g.__getitem__)
        print(
            f"  B={b}: here k={best_m} {m[best_m] / m['0']:.2f}x; "
            f"GPU k={best_g} {g[best_g] / g['0']:.2f}x"
        )
    report = {
        "prompt_tokens": prompt_len,
        "tokens_per_s": measured,
        "tokens_per_row_per_round": per_round,
        "pass_seconds": steps,
        "predicted_tokens_per_s": predicted,
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
            for k in ["0", *map(str, ks)]:
                ax.plot(
                    batches,
                    [data[str(b)][k] for b in batches],
                    marker="o",
                    label="plain" if k == "0" else f"k={k}",
                )
            ax.set_xlabel("batch size")
            ax.set_ylabel("tokens/s")
            ax.set_title(title)
            ax.legend()
        fig.tight_layout()
        fig.savefig(OUT / "specbatch.png", dpi=110)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
