"""Fair share between tenants: what it costs the take, and what it gives a small batch.

A private ``redis-server``; jobs are taken and ended by the worker's own lifecycle (the
real take and end scripts), no model runs: this measures the queue, not MLX.

1. Cost: ``--jobs`` jobs taken and ended one by one, queued (a) without tenants, in one
   batch (the queue's own list, as before fair share), (b) without tenants in 10
   batches (taking turns: the lane's ring), (c) by 1 tenant, (d) spread over 10
   tenants. Printed: jobs/s and the Redis time per job (take + end scripts, from
   ``INFO commandstats``), and their ratios to (a).
2. Head-of-line: a ``--big``-job batch, then a 10-job batch, taken until the small one's
   last job: of one tenant (their batches take turns) and as two tenants. Printed: big
   jobs taken before the small batch's last (FIFO, as before turns: all of them).

    .venv/bin/python -m bench.fairshare [--jobs 20000] [--big 200000] [--skip-cost]
"""

from __future__ import annotations

import argparse
import time

from redis import Redis

from producer import Client
from producer.localredis import LocalRedis
from schemas import ResultRecord, keys
from worker.lifecycle.held import Lifecycle


def _submit(conn: Redis, n: int, batch_id: str, tenant: str) -> list[str]:
    bodies = (
        {"model": "m", "messages": [{"role": "user", "content": f"{batch_id} {i}"}]}
        for i in range(n)
    )
    return Client(connection=conn).submit(bodies, batch_id=batch_id, tenant=tenant).job_ids


def _lifecycle(conn: Redis) -> Lifecycle:
    lc = Lifecycle(conn, f"bench-{time.monotonic_ns()}", ["mlxq"])
    lc.register()
    return lc


def _end(lc: Lifecycle, job) -> None:
    record = ResultRecord(
        job_id=job.id,
        batch_id=job.envelope.batch_id,
        custom_id=job.envelope.custom_id,
        status="succeeded",
        finished_at=time.time(),
    )
    lc.end(job, record)


def cost(conn: Redis, jobs: int, tenants: int | None, batches: int = 1) -> tuple[float, float]:
    """Jobs/s and Redis microseconds per job (scripts) taking and ending ``jobs``, in
    ``batches`` batches per tenant (None: the default tenant only)."""
    conn.flushall()
    for t in range(tenants or 1):
        name = keys.DEFAULT_TENANT if tenants is None else f"t{t}"
        for b in range(batches):
            _submit(conn, jobs // (tenants or 1) // batches, f"b{t}-{b}", name)
    lc = _lifecycle(conn)
    conn.config_resetstat()
    start = time.perf_counter()
    n = 0
    while (job := lc.take()) is not None:
        _end(lc, job)
        n += 1
    wall = time.perf_counter() - start
    stats = conn.info("commandstats")
    usec = sum(v["usec"] for k, v in stats.items() if k in ("cmdstat_evalsha", "cmdstat_eval"))
    return n / wall, usec / n


def head_of_line(conn: Redis, big: int, tenants: bool) -> tuple[int, float]:
    """Big-batch jobs taken before the small batch's last one, and seconds submitting
    both."""
    conn.flushall()
    start = time.perf_counter()
    _submit(conn, big, "big", "big-team" if tenants else keys.DEFAULT_TENANT)
    _submit(conn, 10, "small", "small-team" if tenants else keys.DEFAULT_TENANT)
    submitted = time.perf_counter() - start
    lc = _lifecycle(conn)
    bigs = smalls = 0
    pipe = conn.pipeline(transaction=False)
    while smalls < 10 and (job := lc.take()) is not None:
        if keys.batch_of(job.id) == "small":
            smalls += 1
        else:
            bigs += 1
        pipe.hdel(keys.RUNNING, job.id)  # no record: only the order matters here
        if len(pipe) >= 1000:
            pipe.execute()
    pipe.execute()
    return bigs, submitted


def _median(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--jobs", type=int, default=20_000)
    ap.add_argument("--big", type=int, default=200_000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--skip-cost", action="store_true", help="only the head-of-line part")
    args = ap.parse_args()
    with LocalRedis() as server:
        conn = Redis.from_url(server.url)
        print(f"1. take + end of {args.jobs} jobs, one by one (the real scripts), alternated")
        rows = [
            ("no tenants", None, 1),
            ("10 batches", None, 10),
            ("1 tenant", 1, 1),
            ("10 tenants", 10, 1),
        ]
        runs: dict[str, list[tuple[float, float]]] = {label: [] for label, _, _ in rows}
        for r in range(0 if args.skip_cost else args.rounds):
            for label, tenants, batches in rows:
                runs[label].append(cost(conn, args.jobs, tenants, batches))
                rate, usec = runs[label][-1]
                print(f"   round {r + 1} {label:<12} {rate:6.0f} jobs/s  Redis {usec:6.1f} us/job")
        med = {k: (_median([x[0] for x in v]), _median([x[1] for x in v])) for k, v in runs.items()}
        base = med.get("no tenants", (0.0, 0.0))
        for label, (rate, usec) in med.items() if not args.skip_cost else ():
            print(
                f"   median {label:<12} {rate:6.0f} jobs/s ({rate / base[0]:.3f} of no tenants)  "
                f"Redis {usec:6.1f} us/job ({usec / base[1]:.2f}x)"
            )
        print(
            f"2. a {args.big}-job batch, then a 10-job batch: big jobs taken before the last small"
        )
        turns, turns_s = head_of_line(conn, args.big, False)
        fair, fair_s = head_of_line(conn, args.big, True)
        print(f"   one tenant (turns): {turns} (FIFO: {args.big}); submitted in {turns_s:.1f} s")
        print(f"   as two tenants:     {fair}; submitted in {fair_s:.1f} s")
        print(f"   Redis memory: {conn.info('memory')['used_memory_human']}")


if __name__ == "__main__":
    main()
