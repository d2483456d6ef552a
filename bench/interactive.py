"""Interactive requests while a batch runs: gateway latency and batch throughput, side by side.

One worker (in-process, ``--max-batch`` jobs decoding together) on the 12x1024
target serves ``mlxq.interactive`` before ``mlxq``; chat completions come through
the gateway (``producer serve``) at a steady rate, one every ``--every`` seconds.
Arms, in one run:

- idle: the requests alone (the worker has nothing else to do);
- batch: the queued batch jobs alone (their tokens/s, first submit to last record);
- batch + requests: both at once (requests p50 / p99 over idle; batch tokens/s
  over the batch arm);
- one at a time (before): the same with no side batch: a request that does not join
  runs alone between the batch's steps, one after another (the rule before it);
- one step between: no side batch and no credit banked for jobs run alone between the
  batch's steps (``floor_credit_s = 0``: the batch steps once between two of them, the
  rule before the bank);
- before: the same with the running batch not looking at the interactive queue
  (how it was: requests waited for the batch to end).

Each arm starts with nothing measured (``--max-batch auto`` learns its size afresh):
arms that inherit the sizes an earlier arm measured ran up to 1.6x faster than it, an
order effect seen in runs before this reset.

``--long N``: the batch arms again with prompts of about N tokens (long prefills), where
the arms are *batch + requests*, *one at a time (before)* and *whole chunks (before)*
(no side batch, and): steps prefill whole
512-token chunks of 8 prompts, a request joins the batch whatever it is prefilling, and
a prefix prefilled to keep as a job joins does not look at the interactive queue (the
rules before the prefill budget). ``--only-long``: idle and the long arms only;
``--arms now,alone,...``: only those arms (now, always, alone, bank0, nolook, whole;
*always*: the prefill budget on every step, the rule before issue 69). ``--solo``: the
requests sampled with a seed, by prompt lookup: they cannot share a batch (a solo lane
each since issue 69 step 8; before, each ran to its end between two batch steps).

    .venv/bin/python -m bench.interactive [--batch-jobs 96] [--requests 12] [--long 2000] [--solo]
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from dataclasses import replace
from pathlib import Path

import openai
from redis import Redis

from bench.fixtures import model
from bench.gateway import KEY, start_gateway
from producer import Client
from producer.localredis import LocalRedis
from schemas import keys
from schemas.store import read_result
from worker.engine.models import ModelCache
from worker.runner import beside, lanes
from worker.runner.loop import Worker
from worker.runner.runtime import WorkerRuntime
from worker.schedule import step
from worker.schedule.batchsize import BatchMemory
from worker.schedule.policy import SpeculationPolicy

OUT = Path(__file__).parent / "out"
QUEUES = [keys.INTERACTIVE_QUEUE, keys.DEFAULT_QUEUE]


#: ``--solo``: requests that cannot share a batch (sampled with a seed, by prompt lookup).
SOLO = {"temperature": 0.8, "extra_body": {"speculation": {"method": "prompt_lookup"}}}
#: What every request asks besides its prompt (greedy, or :data:`SOLO` with its seed).
FIELDS: dict = {"temperature": 0}


def requests(base: str, target: str, n: int, every: float, tokens: int) -> list[float]:
    """``n`` chat completions, one started every ``every`` seconds: their latencies."""
    client = openai.OpenAI(base_url=base, api_key=KEY, max_retries=0, timeout=900)
    out: list[float] = [0.0] * n

    def one(i: int) -> None:
        start = time.perf_counter()
        client.chat.completions.create(
            model=target,
            messages=[{"role": "user", "content": f"interactive question {i}"}],
            max_tokens=tokens,
            **(FIELDS | ({"seed": i} if FIELDS is SOLO else {})),
        )
        out[i] = time.perf_counter() - start

    threads = []
    for i in range(n):
        t = threading.Thread(target=one, args=(i,))
        t.start()
        threads.append(t)
        time.sleep(every)
    for t in threads:
        t.join()
    return out


def filler(target: str, tokens: int, shift: int = 0) -> str:
    """Words making about ``tokens`` tokens of ``target``'s tokenizer ("" for 0); each
    ``shift`` its own words (arms do not share prompts: a prompt seen before whole is
    kept in the prefix cache as it joins, not prefilled in the batch)."""
    if not tokens:
        return ""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(target)
    sample = " ".join(f"w{i % 97}" for i in range(200))
    per_word = len(tokenizer(sample)["input_ids"]) / 200
    return " ".join(f"w{(i + shift) % 97}" for i in range(round(tokens / per_word)))


def submit_batch(conn: Redis, target: str, n: int, tokens: int, prompt: int, tag: str) -> list[str]:
    text = filler(target, prompt, sum(map(ord, tag)))
    jobs = {
        f"{tag}{i}": {
            "model": target,
            "messages": [{"role": "user", "content": f"batch job {i}. {text}"}],
            "max_tokens": tokens,
            "temperature": 0,
        }
        for i in range(n)
    }
    return Client(connection=conn).submit(jobs, batch_id=tag).job_ids


def serve(
    url: str, rt: WorkerRuntime, max_batch: int | None, stop: threading.Event
) -> threading.Thread:
    def loop() -> None:
        conn = Redis.from_url(url)
        while not stop.is_set():
            Worker(
                conn,
                QUEUES,
                rt,
                name=f"bench{time.monotonic_ns()}",
                max_batch=max_batch,
                burst=True,
            ).work()
            time.sleep(0.05)

    t = threading.Thread(target=loop, daemon=True)
    t.start()
    return t


def batch_rate(conn: Redis, ids: list[str], started: float) -> float:
    records = [read_result(conn, j) for j in ids]
    failed = [r.error for r in records if r.response is None]
    if failed:
        raise SystemExit(f"{len(failed)} batch job(s) failed, e.g. {failed[0]}")
    tokens = sum(r.response.usage.completion_tokens for r in records if r.response)
    return tokens / (max(r.finished_at for r in records) - started)


def joined_whatever_prefilled(view: step.BatchView, cfg: step.StepConfig) -> bool:
    """The join rule before the prefill budget: every step counted, prefill or not, and
    a join paid while no small step was measured."""
    if view.smallest_step_s is None or view.step_s is None:
        return True
    return view.step_s <= cfg.join_slowdown * view.smallest_step_s


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, round(q * (len(values) - 1)))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch-jobs", type=int, default=96)
    ap.add_argument("--batch-tokens", type=int, default=32)
    ap.add_argument("--requests", type=int, default=12)
    ap.add_argument("--every", type=float, default=1.5)
    ap.add_argument("--request-tokens", type=int, default=16)
    ap.add_argument("--max-batch", default="auto", help="auto (the default) or N")
    ap.add_argument("--long", type=int, default=0, help="also with batch prompts this long")
    ap.add_argument("--long-jobs", type=int, default=12, help="batch jobs with long prompts")
    ap.add_argument("--only-long", action="store_true", help="idle and the long arms only")
    ap.add_argument("--arms", default="now,always,alone,bank0,nolook,whole", help="arms to run")
    ap.add_argument("--target", default=None)
    ap.add_argument("--solo", action="store_true", help="requests seeded, by prompt lookup")
    args = ap.parse_args()
    global FIELDS
    FIELDS = SOLO if args.solo else FIELDS
    chosen = set(args.arms.split(","))
    target = args.target or model("wide")
    rt = WorkerRuntime(cache=ModelCache(), policy=SpeculationPolicy("never"))
    report: dict = {"args": vars(args) | {"target": target}, "arms": {}}
    with LocalRedis() as server:
        conn = Redis.from_url(server.url)
        gateway, base = start_gateway(server.url, 1)
        stop = threading.Event()
        serve(server.url, rt, None if args.max_batch == "auto" else int(args.max_batch), stop)
        try:
            requests(base, target, 2, 0.0, 4)  # load the model, warm up
            idle = requests(base, target, args.requests, args.every, args.request_tokens)
            report["arms"]["idle"] = {"p50_s": pct(idle, 0.5), "p99_s": pct(idle, 0.99)}
            report["latencies_s"] = {"idle": idle}  # each request's, in the order sent
            print("idle", report["arms"]["idle"], flush=True)
            prompts = ([] if args.only_long else [0]) + ([args.long] if args.long else [])
            for prompt in prompts:
                suffix = f", {prompt}-token prompts" if prompt else ""
                jobs = args.long_jobs if prompt else args.batch_jobs
                rt.policy.sizes = BatchMemory()  # each arm learns its batch size afresh
                t0 = time.time()
                ids = submit_batch(conn, target, jobs, args.batch_tokens, prompt, f"a{prompt}")
                while conn.llen(keys.rq_queue_key(keys.DEFAULT_QUEUE)) or conn.hlen(keys.RUNNING):
                    time.sleep(0.2)
                alone = batch_rate(conn, ids, t0)
                report["arms"][f"batch{suffix}"] = {"tok_s": alone}
                cfg = rt.step
                arms = [
                    ("batch + requests", "now"),
                    ("prefill budget always (before)", "always"),
                    ("one at a time (before)", "alone"),
                    *(
                        [("whole chunks (before)", "whole")]
                        if prompt
                        else [
                            ("one step between (bank 0)", "bank0"),
                            ("before (no look)", "nolook"),
                        ]
                    ),
                ]
                for i, (arm, how) in enumerate(arms):
                    if how not in chosen:
                        continue
                    cls, side = lanes.Lanes, beside.Beside
                    saved = (cls._look_ahead, step.joins, cls._between_chunks, side.takes)
                    if how == "always":  # the budget on every step (before issue 69)
                        rt.step = replace(cfg, quiet_budget_s=cfg.prefill_budget_s or 0.0)
                    if how == "bank0":
                        rt.step = replace(cfg, floor_credit_s=0.0)
                    if how != "now":  # the rules before the side batch
                        side.takes = lambda self, r: False  # type: ignore[method-assign]
                    if how == "nolook":
                        lanes.Lanes._look_ahead = lambda self: None  # type: ignore[method-assign]
                    if how == "whole":
                        rt.step = replace(cfg, prefill_budget_s=None)
                        lanes.Lanes._between_chunks = lambda self: None  # type: ignore[method-assign]
                        step.joins = joined_whatever_prefilled  # (``step.where`` reads it)
                    try:
                        rt.policy.sizes = BatchMemory()
                        t0 = time.time()
                        tag = f"{'bdcef'[i]}{prompt}"
                        ids = submit_batch(conn, target, jobs, args.batch_tokens, prompt, tag)
                        while not conn.hlen(keys.RUNNING):  # until the batch runs
                            time.sleep(0.05)
                        lat = requests(base, target, args.requests, args.every, args.request_tokens)
                        while conn.llen(keys.rq_queue_key(keys.DEFAULT_QUEUE)) or conn.hlen(
                            keys.RUNNING
                        ):
                            time.sleep(0.2)
                        rate = batch_rate(conn, ids, t0)
                    finally:
                        (
                            cls._look_ahead,
                            step.joins,
                            cls._between_chunks,
                            side.takes,
                        ) = saved  # type: ignore[method-assign]
                        rt.step = cfg
                    row = {
                        "p50_s": pct(lat, 0.5),
                        "p99_s": pct(lat, 0.99),
                        "p50_over_idle": pct(lat, 0.5) / report["arms"]["idle"]["p50_s"],
                        "p99_over_idle": pct(lat, 0.99) / report["arms"]["idle"]["p99_s"],
                        "batch_tok_s": rate,
                        "batch_over_alone": rate / alone,
                        "mean_s": statistics.mean(lat),
                    }
                    report["latencies_s"][f"{arm}{suffix}"] = lat
                    report["arms"][f"{arm}{suffix}"] = row
                    print(
                        f"{arm}{suffix}",
                        json.dumps({k: round(v, 3) for k, v in row.items()}),
                        flush=True,
                    )
            report["preemptions"] = rt.stats.preemptions
        finally:
            stop.set()
            gateway.terminate()
            gateway.wait(30)
    OUT.mkdir(exist_ok=True)
    (OUT / "interactive.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
