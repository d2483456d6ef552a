"""Where a finite queue's time goes in a speculative batch: joins, full rounds, the tail.

``bench.specbatch`` measures batches while every row decodes; ``bench.deepqueue``
measures a queue of jobs end to end through a worker. This sits between: the
same 16 greedy jobs of 64 tokens (the copy pair) through the engines alone (no
Redis), with ``--slots`` rows at most, new rows joining as others end, and
every step put in one of three phases:

- join: a step that prefilled newcomers (a speculative batch's rows end at
  different rounds, each at its own acceptance, so newcomers join one or two at
  a time, each join a prefill pass of its own; a plain batch of equal jobs ends
  and refills all rows at once);
- full: every slot decoding;
- tail: the queue is empty and fewer rows are left (the last rows of a
  speculative batch are the ones its draft predicts worst).

Arms: plain (``BatchEngine``), speculative at each k of ``--ks``, adaptive up to
the largest (``worker.schedule.goodput``); every arm once per round, order rotating,
medians of ``--rounds``. ``--budget S``: each arm also as a worker serving an
interactive queue runs it (``worker.schedule.step.prefill_budget``): newcomers prefill
what the engine prefills in about S seconds a step, at the speed it measured (a
speculative batch's one row at a time, on its own caches, joining once its prompt is in)
instead of in one padded pass.

    bench/run bench.specqueue [--slots 8,16] [--ks 4,6] [--rounds 2] [--budget 0.5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

from bench.fixtures import model
from bench.specbatch import requests
from worker.engine import Prepared, params_for, prompt_tokens
from worker.engine.batch import BatchEngine
from worker.engine.models import ModelCache
from worker.engine.specbatch import SpecBatchEngine
from worker.schedule.goodput import Goodput

OUT = Path(__file__).parent / "out"
PHASES = ("join", "full", "tail")


def run(
    engine: Any, target: Any, reqs: list, slots: int, budget_s: float | None = None
) -> dict[str, Any]:
    """Every request through ``engine``, at most ``slots`` at once; time per phase.
    ``budget_s``: each step's token budget is what it prefills in that many seconds at
    the speed it measured (the step plan's rule)."""
    waiting = list(enumerate(reqs))
    phases = {p: [0, 0.0] for p in PHASES}  # tokens, seconds
    start = time.perf_counter()
    while waiting or len(engine):
        while waiting and len(engine) < slots:
            i, r = waiting.pop(0)
            prompt = prompt_tokens(target.tokenizer, r)
            engine.add(i, Prepared(prompt, params_for(r, len(prompt), target.context_length, 512)))
        if budget_s is not None:
            engine.prefill_budget = int(budget_s * (engine.prefill_rate or 0.0))
        t = time.perf_counter()
        step = engine.step()
        seconds = time.perf_counter() - t
        phase = "join" if step.prefilled else "full" if step.sequences == slots else "tail"
        phases[phase][0] += step.tokens
        phases[phase][1] += seconds
    total = time.perf_counter() - start
    tokens = sum(p[0] for p in phases.values())
    return {"tok_s": tokens / total, "seconds": total, "phases": phases}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--slots", default="8,16")
    ap.add_argument("--ks", default="4,6")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--budget", type=float, default=None, help="also each arm budgeted")
    args = ap.parse_args()
    ks = [int(k) for k in args.ks.split(",")]
    base = [0, *ks, -max(ks)]  # plain, each k, adaptive up to the largest
    # (k, budget): each arm whole, and budgeted with --budget
    arms = [(k, None) for k in base] + ([(k, args.budget) for k in base] if args.budget else [])
    cache = ModelCache()
    target, _ = cache.get(model("wide"))
    draft, _ = cache.get(model("copy"))
    reqs = requests(model("wide"), args.jobs, args.tokens)

    def engine(arm: tuple[int, float | None], slots: int) -> Any:
        k, budget = arm
        tokens = None if budget is None else 0  # (the least chunks until a speed is known)
        if k == 0:
            return BatchEngine(target, slots, prefill_budget=tokens)
        planner = Goodput(abs(k)) if k < 0 else None
        return SpecBatchEngine(target, draft, abs(k), planner, prefill_budget=tokens)

    def name(arm: tuple[int, float | None]) -> str:
        k, budget = arm
        kind = "plain" if k == 0 else f"k={k}" if k > 0 else f"adaptive<={-k}"
        return kind + (f", budget {budget:g} s" if budget else "")

    report: dict[str, Any] = {"jobs": args.jobs, "tokens": args.tokens, "slots": {}}
    for slots in (int(s) for s in args.slots.split(",")):
        runs: dict[tuple[int, float | None], list[dict]] = {a: [] for a in arms}
        for r in range(args.rounds):
            for arm in arms[r % len(arms) :] + arms[: r % len(arms)]:
                runs[arm].append(run(engine(arm, slots), target, reqs, slots, arm[1]))
        rows = {}
        for arm, got in runs.items():
            rows[name(arm)] = {
                "tok_s": statistics.median(g["tok_s"] for g in got),
                **{
                    p: {
                        "seconds": statistics.median(g["phases"][p][1] for g in got),
                        "tokens": statistics.median(g["phases"][p][0] for g in got),
                    }
                    for p in PHASES
                },
            }
        plain = rows["plain"]["tok_s"]
        print(f"{args.jobs} jobs x {args.tokens} tokens, {slots} slots (median of rounds):")
        for n, row in rows.items():
            parts = ", ".join(
                f"{p} {row[p]['seconds']:.2f} s / {row[p]['tokens']:.0f} tok"
                + (f" ({row[p]['tokens'] / row[p]['seconds']:.0f}/s)" if row[p]["seconds"] else "")
                for p in PHASES
            )
            print(f"  {n}: {row['tok_s']:.1f} tok/s ({row['tok_s'] / plain:.2f}x plain); {parts}")
        report["slots"][str(slots)] = rows
    OUT.mkdir(exist_ok=True)
    (OUT / "specqueue.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
