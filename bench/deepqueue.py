"""Batch or speculate: a deep queue of draft jobs through a real worker, three ways.

N greedy jobs naming a draft wait in the queue at once; an in-process mlxq
worker (real Redis, the real lifecycle, real result records) serves them:

- speculate one at a time: ``--max-batch 1``, ``--speculative auto`` (its
  policy warmed by a first pass, so it runs its best draft length);
  (a batched pass warms MLX's buffers for batches before anything is timed)
- batch without the draft: ``--max-batch 8``, ``--speculative never``;
- speculative batches: ``--max-batch 8``, ``--speculative always`` at each k of
  ``--ks`` (the draft proposes k tokens for every sequence of the batch, the
  target verifies them all in one pass: ``worker.engine.specbatch``), and one that
  chooses each round's k up to ``--adaptive-cap`` (``worker.schedule.goodput``: what
  auto runs when it picks a speculative batch);
- auto: ``--max-batch 8``, ``--speculative auto``, from a fresh policy (cold:
  it first measures the pair one job at a time, then a plain batch), a second
  pass (it measures a speculative batch), and again with all it measured (warm).

Throughput is completion tokens over wall time from submit to the last
result. Synthetic models (bench/fixtures.py).

Every arm runs once per round, in an order that rotates from round to round, and
the figures are medians over rounds (``--rounds``): this VM's speed drifts by 2x
within minutes, so arms run one after another are not comparable.

    .venv/bin/python -m bench.deepqueue [--jobs 16] [--max-tokens 32] [--max-batch 8]
        [--ks 1,2,3,4,6] [--pairs copy,unrelated] [--rounds 3] [--eagle3] [--dflash]
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
from collections import Counter
from pathlib import Path
from typing import Any

from redis import Redis

from bench.fixtures import model
from bench.plots import grouped_bars
from bench.serve import burst
from producer.localredis import LocalRedis
from worker.engine.models import ModelCache
from worker.runner import runtime
from worker.schedule.policy import Decision, SpeculationPolicy


class AdaptivePolicy(SpeculationPolicy):
    """Batches every draft job speculatively, each round's k chosen by the batch (up to
    ``cap``): what auto runs when it picks a speculative batch, as a fixed arm."""

    def __init__(self, cap: int) -> None:
        super().__init__("always", default_k=cap)

    def batch_instead(self, *args: Any, **kwargs: Any) -> Decision | None:
        decision = super().batch_instead(*args, **kwargs)
        if decision is None or not decision.speculative:
            return decision
        return Decision(self.default_k, f"bench: adaptive up to {self.default_k}", adaptive=True)


OUT = Path(__file__).parent / "out"


def bodies(
    target: str, draft: str, n: int, max_tokens: int, contents: list[str] | None = None
) -> list[dict]:
    contents = contents or [f"Job {i}: tell me about queues." for i in range(n)]
    return [
        {
            "model": target,
            "draft_model": draft,
            "temperature": 0,
            "max_tokens": max_tokens,
            "messages": [{"role": "user", "content": contents[i % len(contents)]}],
        }
        for i in range(n)
    ]


def serve(url: str, jobs: list[dict], rt: runtime.WorkerRuntime, max_batch: int) -> dict:
    """Submit ``jobs`` at once, serve them with one worker; throughput and what ran."""
    records, elapsed = burst(Redis.from_url(url), jobs, rt, max_batch)
    tokens = sum(r.response.usage.completion_tokens for r in records if r.response)
    ran = Counter(  # a batch's last job finishes alone (batch_size 1): the reason tells
        "batched"
        if r.metrics.batch_size > 1 or "batch" in (r.metrics.speculation_reason or "")
        else f"alone k={r.metrics.num_draft_tokens or 0}"
        for r in records
    )
    texts = [r.response.choices[0].message.content for r in records if r.response]
    reason = Counter(r.metrics.speculation_reason for r in records).most_common(1)[0][0]
    return {
        "tok_s": tokens / elapsed,
        "seconds": elapsed,
        "ran": dict(ran),
        "texts": texts,
        "reason": reason,
    }


def auto_pass(url: str, jobs: list[dict], rt: Any, max_batch: int) -> dict:
    """auto from a fresh policy (cold: it measures the pair one job at a time, then a
    plain batch), a second pass (it measures a speculative batch), then again with all
    it measured (warm)."""
    policy = SpeculationPolicy("auto")
    cold = serve(url, jobs, rt(policy), max_batch)
    serve(url, jobs, rt(policy), max_batch)
    warm = serve(url, jobs, rt(policy), max_batch)
    measured = {
        str(k): {str(n): round(a.value, 1) for n, a in v.by_size.items()}
        for k, v in (policy.sizes.plain | policy.sizes.spec).items()
    }
    measured |= {f"whole {k}": round(a.value, 1) for k, a in policy.sizes.whole.items()}
    return {"cold": cold, "warm": warm, "measured": measured, "reason": warm["reason"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--max-batch", type=int, default=8)
    ap.add_argument("--ks", default="1,2,3,4,6", help="draft lengths of the speculative batches")
    ap.add_argument("--adaptive-cap", type=int, default=6, help="the adaptive arm's largest k")
    ap.add_argument("--pairs", default="copy,unrelated")
    ap.add_argument("--rounds", type=int, default=1, help="every arm per round, order rotating")
    ap.add_argument(
        "--eagle3",
        action="store_true",
        help="also bench.trained's target with its EAGLE-3 head (bench/eagle.py), held-out prompts",
    )
    ap.add_argument("--dflash", action="store_true", help="the same with its DFlash drafter")
    args = ap.parse_args()
    ks = [int(k) for k in args.ks.split(",") if k]
    wide = model("wide")
    pairs = [(f"{p} (synthetic)", wide, model(p), None) for p in args.pairs.split(",") if p]
    if args.eagle3 or args.dflash:
        from bench import trained
        from bench.eagle import DFLASH_STEPS, ensure_drafter

        t, _ = trained.ensure_pair()
        held = trained.prompts(args.jobs)
        if args.eagle3:
            pairs.append(("cpython + EAGLE-3 (trained)", t, ensure_drafter(t, 400, 64), held))
        if args.dflash:
            drafter = ensure_drafter(t, DFLASH_STEPS, 64, "dflash")
            pairs.append(("cpython + DFlash (trained)", t, drafter, held))
    target = wide
    cache = ModelCache()
    report: dict = {"jobs": args.jobs, "max_tokens": args.max_tokens}
    rows: dict[str, dict] = {}
    with LocalRedis() as server:
        for name, target, draft, contents in pairs:
            jobs = bodies(target, draft, args.jobs, args.max_tokens, contents)

            def rt(policy: SpeculationPolicy) -> runtime.WorkerRuntime:
                return runtime.WorkerRuntime(cache=cache, worker_id="deep", policy=policy)

            alone_policy = SpeculationPolicy("auto")
            serve(server.url, jobs, rt(alone_policy), 1)  # warm the models and the policy
            serve(server.url, jobs, rt(SpeculationPolicy("never")), args.max_batch)  # and batches
            url, size = server.url, args.max_batch
            arms: dict[str, Any] = {
                "speculate one at a time": functools.partial(serve, url, jobs, rt(alone_policy), 1),
                "batch without draft": functools.partial(
                    serve, url, jobs, rt(SpeculationPolicy("never")), size
                ),
                **{
                    f"spec batch k={k}": functools.partial(
                        serve, url, jobs, rt(SpeculationPolicy("always", default_k=k)), size
                    )
                    for k in ks
                },
                f"spec batch adaptive k<={args.adaptive_cap}": functools.partial(
                    serve, url, jobs, rt(AdaptivePolicy(args.adaptive_cap)), size
                ),
                "auto": functools.partial(auto_pass, url, jobs, rt, size),
            }
            runs: dict[str, list[dict]] = {arm: [] for arm in arms}
            names_ = list(arms)
            for r in range(args.rounds):  # each round runs every arm, in a rotating order
                for arm in names_[r % len(names_) :] + names_[: r % len(names_)]:
                    runs[arm].append(arms[arm]())
            rate = {
                arm: statistics.median(x["tok_s"] for x in v)
                for arm, v in runs.items()
                if arm != "auto"
            }
            rate["auto cold"] = statistics.median(x["cold"]["tok_s"] for x in runs["auto"])
            rate["auto warm"] = statistics.median(x["warm"]["tok_s"] for x in runs["auto"])
            spec_arms = [f"spec batch k={k}" for k in ks]
            spec_arms.append(f"spec batch adaptive k<={args.adaptive_cap}")
            best_spec = max(spec_arms, key=rate.__getitem__) if spec_arms else None
            fixed = ["speculate one at a time", "batch without draft", *spec_arms]
            paired = (
                [  # per round: the best speculative batch / the better of the other two
                    max(runs[a][i]["tok_s"] for a in spec_arms)
                    / max(runs[a][i]["tok_s"] for a in fixed[:2])
                    for i in range(args.rounds)
                ]
                if spec_arms
                else []
            )
            texts = [x["texts"] for arm in fixed for x in runs[arm]]
            texts += [x[w]["texts"] for x in runs["auto"] for w in ("cold", "warm")]
            last_auto = runs["auto"][-1]
            row = {
                "target": target,
                "tok_s": {arm: round(v, 2) for arm, v in rate.items()},
                "rounds": args.rounds,
                "spec_batch_best": best_spec,
                "spec_batch_over_better_of_batch_and_alone": round(
                    rate[best_spec] / max(rate[a] for a in fixed[:2]), 3
                )
                if best_spec
                else None,
                "same_per_round": [round(x, 3) for x in paired],
                "auto_warm_over_best_fixed": round(
                    rate["auto warm"] / max(rate[a] for a in fixed), 3
                ),
                "auto_cold_over_best_fixed": round(
                    rate["auto cold"] / max(rate[a] for a in fixed), 3
                ),
                "ran": {
                    "alone": runs["speculate one at a time"][-1]["ran"],
                    "auto cold": last_auto["cold"]["ran"],
                    "auto warm": last_auto["warm"]["ran"],
                },
                "greedy_outputs_equal": all(t == texts[0] for t in texts),
                "auto_warm_reason": last_auto["reason"],
                "batch_speeds_measured": last_auto["measured"],
            }
            rows[name] = row
            print(name, json.dumps(row), flush=True)
    report["pairs"] = rows
    OUT.mkdir(exist_ok=True)
    (OUT / "deepqueue.json").write_text(json.dumps(report, indent=1))
    names = list(rows)
    grouped_bars(
        OUT / "deepqueue.png",
        f"{args.jobs} queued draft jobs: batch or speculate",
        names,
        {k: [rows[n]["tok_s"][k] for n in names] for k in rows[names[0]]["tok_s"]},
        "tokens/s",
    )


if __name__ == "__main__":
    main()
