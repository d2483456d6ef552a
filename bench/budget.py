"""Plain jobs under the default queues: the prefill budget only while someone waits.

A worker serves ``mlxq.interactive`` before ``mlxq`` by default, so its batches on
``mlxq`` once cut every step's prompt prefill to about 0.5 s (someone might wait on the
next step) whether or not anything waited. N greedy jobs of ``--max-tokens`` tokens
queued at once on ``mlxq``, one in-process burst worker (``--max-batch auto``, the model
loaded and warmed first), arms in one run, the order rotating each round:

- now: the default queues; the 0.5 s budget applies while an interactive job is in the
  batch, beside it, or was seen waiting in the last 5 s (none here), else a 4 s one;
- budget always (before): the default queues with the budget on every step;
- batch queue only: the worker serves ``mlxq`` alone (no budget);
- ``mlx_lm.server`` with its defaults, every request sent at once.

Prints tokens/s per arm and round, and each arm over the server; texts equal.

    .venv/bin/python -m bench.budget [--target PATH] [--jobs 32] [--max-tokens 64] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from redis import Redis

from bench.batchsize import bodies, through_server
from bench.fixtures import model
from bench.peer import mlx_lm_server, send_all
from bench.serve import burst
from producer.localredis import LocalRedis
from schemas import keys
from worker.engine.models import ModelCache
from worker.runner import runtime
from worker.schedule.step import StepConfig

OUT = Path(__file__).parent / "out"
DEFAULT = (keys.INTERACTIVE_QUEUE, keys.DEFAULT_QUEUE)


def worker_arm(conn: Redis, jobs: list[dict], cache: ModelCache, queues, always: bool) -> dict:
    step = StepConfig()
    if always:  # the rule before: a budget on every step while the queues ahead are served
        step = replace(step, quiet_budget_s=step.prefill_budget_s or 0.0)
    rt = runtime.WorkerRuntime(cache=cache, worker_id="bench-budget", step=step)
    records, elapsed = burst(conn, jobs, rt, None, queues)
    tokens = sum(r.response.usage.completion_tokens for r in records)
    return {
        "tok_s": tokens / elapsed,
        "largest_batch": max(r.metrics.batch_size for r in records),
        "texts": [r.response.choices[0].message.content for r in records],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default=None, help="model path [default: the 12x1024 target]")
    ap.add_argument("--jobs", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    target = args.target or model("wide")
    jobs = bodies(target, args.jobs, args.max_tokens)
    runs: dict[str, list[dict]] = {}
    with LocalRedis() as r:
        conn = Redis.from_url(r.url)
        cache = ModelCache()
        cache.get(target)
        worker_arm(conn, bodies(target, 8, 4, tag="warm "), cache, DEFAULT, False)
        arms: dict[str, Callable[[], dict]] = {
            "now": lambda: worker_arm(conn, jobs, cache, DEFAULT, False),
            "budget always (before)": lambda: worker_arm(conn, jobs, cache, DEFAULT, True),
            "batch queue only": lambda: worker_arm(conn, jobs, cache, ("mlxq",), False),
        }
        with mlx_lm_server(target) as port:
            send_all(port, bodies(target, args.jobs, 4, tag="warm "))
            arms["mlx_lm.server"] = lambda: through_server(port, jobs)
            names = list(arms)
            for n in range(args.rounds):
                for name in names[n % len(names) :] + names[: n % len(names)]:
                    runs.setdefault(name, []).append(arms[name]())
                    print(
                        f"round {n + 1} {name}: {runs[name][-1]['tok_s']:.1f} tok/s",
                        file=sys.stderr,
                    )
    reference = runs["now"][0]["texts"]
    print(f"{Path(target).name}: {args.jobs} jobs x {args.max_tokens} tokens")
    for name, rows in runs.items():
        over = [x["tok_s"] / s["tok_s"] for x, s in zip(rows, runs["mlx_lm.server"], strict=True)]
        batch = rows[-1].get("largest_batch", "-")
        print(
            f"{name:<24} " + " ".join(f"{x['tok_s']:7.1f}" for x in rows) + " tok/s  "
            "over the server " + " ".join(f"{o:.2f}x" for o in over) + f"  largest batch {batch}"
        )
    same = all(x["texts"] == reference for a, v in runs.items() if a != "mlx_lm.server" for x in v)
    served = sum(a == b for a, b in zip(runs["mlx_lm.server"][0]["texts"], reference, strict=True))
    print(f"mlxq texts equal across arms: {same}; the server's equal: {served}/{args.jobs}")
    OUT.mkdir(exist_ok=True)
    slim = {
        a: [{k: v for k, v in x.items() if k != "texts"} for x in rows] for a, rows in runs.items()
    }
    (OUT / f"budget-{Path(target).name}.json").write_text(json.dumps(slim, indent=1))


if __name__ == "__main__":
    main()
