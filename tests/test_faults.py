"""Fault injection with real processes: SIGKILL, SIGTERM, Redis restarts, timeouts, bad hashes.

Workers run as real ``worker`` processes against a real redis-server. Each test
asserts the promise: every accepted job ends with exactly one result record.
Figures (kills, recoveries, recovery time) are appended to FAULT_REPORT.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest
from redis import Redis

from producer import Client
from producer.localredis import LocalRedis
from schemas import keys
from schemas.store import read_result
from tests.conftest import chat, run_worker
from tests.waiting import seconds, wait_for

FAULT_REPORT: list[dict] = []
SLOW_TOKENS = 1500  # ~5 s on the slow tiny model without OpenBLAS


def slow_job(tiny, **fields) -> dict:
    # EOS (id 3) is banned so the job really generates SLOW_TOKENS tokens.
    fields = {"max_tokens": SLOW_TOKENS, **fields}
    return chat(tiny.slow, temperature=0, logit_bias={"3": -100}, **fields)


def running_execution(conn: Redis, job_id: str, queue: str = "mlxq") -> str | None:
    for m in conn.zrange(keys.rq_started_key(queue), 0, -1):
        jid, _, execution = m.decode().partition(":")
        if jid == job_id:
            return execution
    return None


def one_result(conn: Redis, job_id: str, timeout: float = 90):
    record = wait_for(lambda: read_result(conn, job_id), timeout=timeout, every=0.1)
    batch = keys.batch_of(job_id)
    done = [j.decode() for j in conn.lrange(keys.batch_done_key(batch), 0, -1)]
    assert done.count(job_id) == 1, "the job must be announced exactly once"
    return record


def test_sigkill_mid_job_is_recovered_and_completes(conn, redis_url, tiny, workers):
    client = Client(connection=conn)
    s = client.submit({"slow": slow_job(tiny), "quick": chat(tiny.target, max_tokens=3)})
    slow_id = s.job_ids[0]
    a = workers("--lease-seconds", "2", name="a")
    first = wait_for(lambda: running_execution(conn, slow_id))
    a.signal(signal.SIGKILL)
    killed_at = time.monotonic()
    a.wait()
    b = workers("--lease-seconds", "2", name="b")
    second = wait_for(lambda: (e := running_execution(conn, slow_id)) and e != first and e)
    recovery_s = time.monotonic() - killed_at
    record = one_result(conn, slow_id)
    assert record.status == "succeeded"
    assert record.response.usage.completion_tokens == SLOW_TOKENS
    assert conn.get(keys.crashes_key(slow_id)) == b"1"
    assert one_result(conn, s.job_ids[1]).status == "succeeded"
    status = client.status(s.batch_id)
    assert (status.succeeded, status.failed) == (2, 0)
    assert second != first
    # lease 2 s + a recovery pass every 1 s, plus the new worker's start-up.
    assert recovery_s < seconds(15), recovery_s
    FAULT_REPORT.append({"test": "sigkill", "kills": 1, "recovery_s": round(recovery_s, 2)})
    b.signal(signal.SIGTERM)
    assert b.wait() == 0


def test_job_that_keeps_killing_its_worker_becomes_poison(conn, redis_url, tiny, workers):
    client = Client(connection=conn)
    s = client.submit({"poison": slow_job(tiny)})
    job_id = s.job_ids[0]
    seen: set[str] = set()
    for i in range(2):
        w = workers("--lease-seconds", "2", "--max-crashes", "2", name=f"p{i}")
        execution = wait_for(lambda: (e := running_execution(conn, job_id)) and e not in seen and e)
        seen.add(execution)
        w.signal(signal.SIGKILL)
        w.wait()
    last = workers("--lease-seconds", "2", "--max-crashes", "2", name="survivor")
    record = one_result(conn, job_id)
    assert record.status == "failed" and record.error.code == "poison_job"
    assert "died 2 times" in record.error.message
    after = client.submit([chat(tiny.target, max_tokens=2)])
    assert one_result(conn, after.job_ids[0]).status == "succeeded"
    assert client.status(s.batch_id).failed == 1
    FAULT_REPORT.append({"test": "poison", "kills": 2, "poisoned": 1})
    last.signal(signal.SIGTERM)
    assert last.wait() == 0


def test_restart_under_same_name_right_after_sigkill(conn, redis_url, tiny, workers):
    s = Client(connection=conn).submit({"slow": slow_job(tiny)})
    job_id = s.job_ids[0]
    a = workers("--lease-seconds", "30", name="mini-1")
    wait_for(lambda: running_execution(conn, job_id))
    a.signal(signal.SIGKILL)
    a.wait()
    killed_at = time.monotonic()
    first = running_execution(conn, job_id)
    again = workers("--lease-seconds", "30", name="mini-1")
    # The job came back at once (running again under a new execution), not after the 30 s
    # lease; timed to its restart, not its end (its 1,500 tokens take longer under load).
    wait_for(lambda: (e := running_execution(conn, job_id)) and e != first, timeout=25)
    took = time.monotonic() - killed_at
    record = one_result(conn, job_id)
    assert record.status == "succeeded"
    assert took < seconds(25), took
    assert "name reclaimed" in again.output
    FAULT_REPORT.append({"test": "same-name restart", "kills": 1, "recovered_in_s": round(took, 2)})
    again.signal(signal.SIGTERM)
    assert again.wait() == 0


def test_sigterm_finishes_the_job_then_exits_zero(conn, redis_url, tiny, workers):
    client = Client(connection=conn)
    s = client.submit({"slow": slow_job(tiny), "next": chat(tiny.target, max_tokens=2)})
    w = workers(name="term")
    w.begun(s.job_ids[0])
    w.signal(signal.SIGTERM)
    assert w.wait(120) == 0
    record = read_result(conn, s.job_ids[0])
    assert record.status == "succeeded"
    assert record.response.usage.completion_tokens == SLOW_TOKENS
    assert read_result(conn, s.job_ids[1]) is None  # not started after the stop request
    assert conn.lrange(keys.rq_queue_key("mlxq"), 0, -1) == [s.job_ids[1].encode()]


def test_second_sigterm_requeues_the_job(conn, redis_url, tiny, workers):
    s = Client(connection=conn).submit({"slow": slow_job(tiny)})
    job_id = s.job_ids[0]
    w = workers(name="cold")
    wait_for(lambda: running_execution(conn, job_id))
    w.signal(signal.SIGTERM)
    time.sleep(1.2)  # RQ ignores a repeat within one second
    w.signal(signal.SIGTERM)
    assert w.wait(60) == 0
    assert read_result(conn, job_id) is None
    assert conn.lrange(keys.rq_queue_key("mlxq"), 0, -1) == [job_id.encode()]
    assert conn.hget(keys.rq_job_key(job_id), "status") == b"queued"
    assert running_execution(conn, job_id) is None
    assert conn.zcard("rq:failed:mlxq") == 0
    run_worker(redis_url)
    assert one_result(conn, job_id).status == "succeeded"
    FAULT_REPORT.append({"test": "double sigterm", "signals": 2, "requeued": 1})


def test_redis_restart_mid_job_and_while_idle(tmp_path, tiny, workers):
    server = LocalRedis(data_dir=tmp_path / "aof", appendonly=True).start()
    try:
        conn = Redis.from_url(server.url)
        client = Client(connection=conn)
        s = client.submit({"slow": slow_job(tiny)})
        w = workers(name="r", url=server.url)
        wait_for(lambda: running_execution(conn, s.job_ids[0]))
        server.stop()
        time.sleep(3)  # Redis is away for a few seconds mid-job
        server.start()
        record = one_result(conn, s.job_ids[0])
        assert record.status == "succeeded"
        server.stop()  # and once more while the worker is idle
        time.sleep(2)
        server.start()
        after = client.submit([chat(tiny.target, max_tokens=2)])
        assert one_result(conn, after.job_ids[0]).status == "succeeded"
        assert w.proc.poll() is None, w.output
        FAULT_REPORT.append({"test": "redis restarts", "restarts": 2, "lost": 0})
        w.signal(signal.SIGTERM)
        assert w.wait() == 0
    finally:
        server.stop()


def _stopped_within(w, seconds: float) -> float:
    """Seconds the worker process took to exit after the last signal (fails past ``seconds``)."""
    sent = time.monotonic()
    try:
        w.wait(seconds)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"still running {seconds}s after the signal:\n{w.output}") from None
    return time.monotonic() - sent


def test_sigterm_stops_an_idle_worker_whose_redis_is_gone(tmp_path, tiny, workers):
    """The worker holds no job and retries an unreachable Redis (redis-py's retries run
    for minutes): one SIGTERM ends it within seconds, exit 0."""
    server = LocalRedis().start()
    try:
        w = workers(name="gone", url=server.url)
        conn = Redis.from_url(server.url)
        wait_for(lambda: conn.exists(keys.worker_key("gone")), timeout=30)
        assert f"worker gone: serving mlxq.interactive, mlxq from {server.url}" in w.output
        server.stop()
        time.sleep(3)  # the worker is retrying its take
        assert w.proc.poll() is None
        w.signal(signal.SIGTERM)
        took = _stopped_within(w, seconds(8))
        assert w.proc.returncode == 0, w.output
        assert "stopped while waiting for a job" in w.output
        FAULT_REPORT.append({"test": "sigterm, redis gone, idle", "exit_s": round(took, 2)})
    finally:
        server.stop()


def test_a_second_sigterm_stops_a_busy_worker_whose_redis_is_gone(tmp_path, tiny, workers):
    """With a job held, the first SIGTERM lets it finish (its record cannot be written:
    Redis is gone); the second ends the worker at once. The job is not lost: it stays
    held in Redis, which hands it back when the lease ends."""
    server = LocalRedis(data_dir=tmp_path / "aof", appendonly=True).start()
    try:
        conn = Redis.from_url(server.url)
        s = Client(connection=conn).submit({"slow": slow_job(tiny)})
        w = workers("--lease-seconds", "3", name="busy", url=server.url)
        w.begun(s.job_ids[0])
        w.signal(signal.SIGTERM)  # warm: the job runs on
        server.stop()
        time.sleep(1)
        assert w.proc.poll() is None, w.output
        w.signal(signal.SIGTERM)
        took = _stopped_within(w, seconds(8))
        assert "cold stop" in w.output, w.output
        server.start()  # the job was held, not lost: another worker runs it
        workers("--lease-seconds", "3", name="next", url=server.url)
        assert one_result(conn, s.job_ids[0]).status == "succeeded"
        FAULT_REPORT.append({"test": "2nd sigterm, redis gone, busy", "exit_s": round(took, 2)})
    finally:
        server.stop()


def test_job_timeout_fails_clearly_and_the_worker_goes_on(conn, redis_url, tiny):
    client = Client(connection=conn)
    # 8,000 tokens: far more than one second gives on any machine
    slow = client.submit([slow_job(tiny, max_tokens=8000)], job_timeout=1)
    quick = client.submit([chat(tiny.slow, max_tokens=2)])
    from worker.engine.models import ModelCache
    from worker.runner import runtime

    run_worker(redis_url, runtime=runtime.WorkerRuntime(cache=ModelCache()))
    record = read_result(conn, slow.job_ids[0])
    assert record.status == "failed" and record.error.code == "timeout"
    assert "timed out" in record.error.message
    after = read_result(conn, quick.job_ids[0])
    assert after.status == "succeeded" and after.metrics.cache_hit is True


def test_job_left_in_a_dead_workers_inbox_is_put_back(conn, redis_url, tiny):
    from worker.lifecycle.held import Lifecycle

    s = Client(connection=conn).submit([chat(tiny.target, max_tokens=2)])
    job_id = s.job_ids[0]
    # A worker's blocking wait moved the id into its inbox, then the process died.
    dead = Lifecycle(conn, "dead", ["mlxq"], lease_s=30)
    dead.register()
    assert conn.blmove(keys.rq_queue_key("mlxq"), dead.inbox, 1, "LEFT", "RIGHT") is not None
    other = Lifecycle(conn, "other", ["mlxq"], lease_s=30)
    other.register()
    assert other.recover() == []  # its lease still runs: nothing to do
    conn.zadd(keys.LEASES, {dead.token: 0})  # ...and now it has run out
    assert [(r.kind, r.job_id) for r in other.recover()] == [("inbox", job_id)]
    assert conn.lrange(keys.rq_queue_key("mlxq"), 0, -1) == [job_id.encode()]
    assert not conn.exists(dead.inbox) and not conn.hexists(keys.HOLDERS, dead.token)
    other.unregister()
    run_worker(redis_url)
    assert one_result(conn, job_id).status == "succeeded"


def test_several_queues_first_queue_first_and_nothing_left_held(conn, redis_url, tiny):
    a = Client(connection=conn, queue="high").submit([chat(tiny.target, max_tokens=2)])
    b = Client(connection=conn, queue="low").submit([chat(tiny.target, max_tokens=2)])
    run_worker(redis_url, queues=("high", "low"))
    assert read_result(conn, a.job_ids[0]).status == "succeeded"
    assert read_result(conn, b.job_ids[0]).status == "succeeded"
    assert read_result(conn, a.job_ids[0]).finished_at < read_result(conn, b.job_ids[0]).finished_at
    assert conn.hlen(keys.RUNNING) == 0 and conn.keys("mlxq:inbox:*") == []
    for q in ("high", "low"):
        assert conn.zcard(keys.rq_started_key(q)) == 0


def test_missing_and_corrupt_job_hashes_are_dead_lettered(conn, redis_url, tiny):
    conn.rpush(keys.rq_queue_key("mlxq"), "ghost-1")
    conn.hset(keys.rq_job_key("broken-1"), mapping={"status": "not-a-status", "data": b"\x00"})
    conn.rpush(keys.rq_queue_key("mlxq"), "broken-1")
    good = Client(connection=conn).submit([chat(tiny.target, max_tokens=2)])
    run_worker(redis_url)
    dead = [json.loads(x) for x in conn.lrange(keys.DEAD_LETTERS, 0, -1)]
    reasons = {d["job_id"]: d["reason"] for d in dead}
    assert "no job hash" in reasons["ghost-1"]
    assert "not JSON" in reasons["broken-1"]
    assert read_result(conn, good.job_ids[0]).status == "succeeded"
    assert conn.hlen(keys.RUNNING) == 0 and conn.llen(keys.rq_queue_key("mlxq")) == 0


def test_credentials_never_reach_logs_or_results(tmp_path, tiny, workers):
    secret = "s3cret-pa55"
    port = LocalRedis().port
    proc = subprocess.Popen(
        [
            "redis-server",
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--requirepass",
            secret,
        ],
        stdout=subprocess.DEVNULL,
    )
    try:
        url = f"redis://:{secret}@127.0.0.1:{port}/0"
        conn = Redis.from_url(url)
        wait_for(lambda: _pings(conn), timeout=10)
        s = Client(connection=conn).submit([chat(tiny.target, max_tokens=2)])
        w = workers("-vv", "--burst", name="cred", url=url)
        assert w.wait() == 0
        raw = conn.get(keys.result_key(s.job_ids[0])).decode()
        assert json.loads(raw)["status"] == "succeeded"
        assert secret not in raw
        assert "Worker" in w.output or "job" in w.output
        assert secret not in w.output
        bad = workers("--burst", name="bad", url=f"redis://:wrong-{secret}@127.0.0.1:{port}/0")
        assert bad.wait() == 1
        assert secret not in bad.output and "***" in bad.output
    finally:
        proc.terminate()
        proc.wait(seconds(10))


def _pings(conn: Redis) -> bool:
    try:
        return bool(conn.ping())
    except Exception:
        return False


def test_sigterm_while_idle_exits_zero_and_loses_nothing(conn, redis_url, tiny, workers):
    w = workers(name="idle")
    w.serving()
    time.sleep(0.5)  # most likely blocked in the dequeue wait (a stop before it ends alike)
    w.signal(signal.SIGTERM)
    assert w.wait(30) == 0
    s = Client(connection=conn).submit([chat(tiny.target, max_tokens=2)])
    assert conn.lrange(keys.rq_queue_key("mlxq"), 0, -1) == [s.job_ids[0].encode()]
    assert conn.keys("mlxq:inbox:*") == [] and conn.zcard(keys.LEASES) == 0
    run_worker(redis_url)
    assert one_result(conn, s.job_ids[0]).status == "succeeded"


def tokens_lasting(tiny, seconds_: float) -> int:
    """Tokens the slow tiny model takes at least ``seconds_`` to decode here (measured in
    this process: a worker beside other work is slower still), at most 8,000 (its
    context)."""
    import mlx_lm

    model, tok = mlx_lm.load(tiny.slow)
    started = time.perf_counter()
    made = sum(1 for _ in mlx_lm.stream_generate(model, tok, "hello", max_tokens=200))
    per_s = made / (time.perf_counter() - started)  # (at a short context: fast)
    return min(8000, max(SLOW_TOKENS, int(per_s * seconds_)))


def test_a_long_job_outlives_its_lease_without_being_requeued(conn, redis_url, tiny, workers):
    s = Client(connection=conn).submit([slow_job(tiny, max_tokens=tokens_lasting(tiny, 4))])
    w = workers("--lease-seconds", "2", name="long")
    first = wait_for(lambda: running_execution(conn, s.job_ids[0]))
    record = one_result(conn, s.job_ids[0])
    assert record.status == "succeeded" and record.metrics.total_time_s > 3  # > 1.5 leases
    assert conn.get(keys.crashes_key(s.job_ids[0])) is None
    assert first is not None
    w.signal(signal.SIGTERM)
    assert w.wait() == 0


def _slow_of(arch: str, tiny, tmp_path_factory) -> str:
    """The slow model's size (4 x 256) in another architecture (window 16)."""
    if arch == "llama":
        return tiny.slow
    from worker.dev.tinymodels import TinySpec, ensure_model

    spec = TinySpec(arch=arch, layers=4, hidden=256, intermediate=512, context=8192, seed=5)
    return str(ensure_model(tmp_path_factory.getbasetemp() / f"slow-{arch}", spec))


@pytest.mark.parametrize(
    "speculative,arch",
    [
        (False, "llama"),
        (True, "llama"),
        (True, "gemma3_text"),
        (True, "qwen3_5"),
        (True, "eagle3"),
        (True, "dflash"),
    ],
)
def test_sigkill_mid_batch_recovers_every_job(
    conn, redis_url, tiny, workers, speculative, arch, tmp_path_factory
):
    """On llama-shaped, sliding-window and hybrid models alike, and with an EAGLE-3 or a
    DFlash drafter proposing (untrained: their proposals are nearly all rejected)."""
    client = Client(connection=conn)
    drafter = arch in ("eagle3", "dflash")
    model = _slow_of("llama" if drafter else arch, tiny, tmp_path_factory)
    tokens = SLOW_TOKENS if arch == "llama" else 400  # (the others are slower per token)
    # Its own draft: every proposal accepted, so a round costs what plain decoding does.
    extra = {"draft_model": model} if speculative else {}
    if drafter:
        from worker.dev.tinydrafters import write_dflash, write_eagle3

        write = write_eagle3 if arch == "eagle3" else write_dflash
        root = tmp_path_factory.getbasetemp() / f"slow-{arch}"
        extra = {"draft_model": str(write(root, model, seed=3))}
    s = client.submit(
        {
            f"s{i}": chat(
                model,
                content=f"job {i}",
                max_tokens=tokens,
                temperature=0,
                logit_bias={"3": -100},
                **extra,
            )
            for i in range(3)
        }
    )
    args = ("--lease-seconds", "2", "--max-batch", "4", "--speculative", "always")
    a = workers(*args, name="batch-a")
    wait_for(lambda: all(running_execution(conn, j) for j in s.job_ids))  # all in one batch
    a.signal(signal.SIGKILL)
    a.wait()
    b = workers(*args, name="batch-b")
    records = [one_result(conn, j, timeout=180) for j in s.job_ids]
    assert all(r.status == "succeeded" for r in records)
    assert all(r.response.usage.completion_tokens == tokens for r in records)
    assert all(r.metrics.speculative == speculative for r in records)
    if speculative:  # they ran in a speculative batch, after the kill too
        assert all(r.metrics.batch_size > 1 and r.metrics.draft_tokens_proposed for r in records)
    assert all(conn.get(keys.crashes_key(j)) == b"1" for j in s.job_ids)
    name = "sigkill mid-batch" + (f" (speculative, {arch})" if speculative else "")
    FAULT_REPORT.append({"test": name, "kills": 1, "jobs_recovered": 3})
    b.signal(signal.SIGTERM)
    assert b.wait() == 0


def test_a_job_taken_again_while_it_runs_in_the_batch_runs_once(conn, redis_url, tiny, workers):
    """A job whose lease here was counted lost (a Sentinel failover can lose its renewals)
    is requeued and may be taken by this very worker while its batch still decodes it.
    It must not join as a second sequence (found in the failover test: the second end
    failed the whole batch and left a job held for ever): it runs on, one record each."""
    # s0 is taken again within a look (0.1 s) of its requeue: a third of SLOW_TOKENS is
    # seconds of margin; "long" outlives s0 twice (the batch goes on after s0's one end)
    tokens = {"s0": SLOW_TOKENS // 3, "s1": SLOW_TOKENS // 3, "long": 2 * SLOW_TOKENS // 3}
    jobs = {k: slow_job(tiny, content=k) | {"max_tokens": n} for k, n in tokens.items()}
    s = Client(connection=conn).submit(jobs)
    w = workers("--max-batch", "4", name="again")
    wait_for(lambda: all(running_execution(conn, j) for j in s.job_ids))
    again = s.job_ids[0]
    with conn.pipeline() as pipe:  # what recovery does to a job whose lease looks lost
        pipe.hdel(keys.RUNNING, again)
        pipe.lpush(keys.rq_queue_key("mlxq"), again)
        pipe.execute()
    records = [one_result(conn, j, timeout=180) for j in s.job_ids]
    assert all(r.status == "succeeded" for r in records), [r.error for r in records]
    assert all(r.response.usage.completion_tokens == tokens[r.custom_id] for r in records)
    wait_for(lambda: conn.hlen(keys.RUNNING) == 0)
    assert "taken again" in w.output
    w.signal(signal.SIGTERM)
    assert w.wait() == 0


def test_second_sigterm_mid_batch_requeues_every_job(conn, redis_url, tiny, workers):
    s = Client(connection=conn).submit({f"s{i}": slow_job(tiny, content=str(i)) for i in range(2)})
    w = workers("--max-batch", "4", name="batch-cold")
    wait_for(lambda: all(running_execution(conn, j) for j in s.job_ids))
    w.signal(signal.SIGTERM)
    time.sleep(1.2)
    w.signal(signal.SIGTERM)
    assert w.wait(60) == 0
    assert sorted(conn.lrange(keys.rq_queue_key("mlxq"), 0, -1)) == sorted(
        j.encode() for j in s.job_ids
    )
    assert all(read_result(conn, j) is None for j in s.job_ids)
    run_worker(redis_url, max_batch=4)
    assert all(one_result(conn, j).status == "succeeded" for j in s.job_ids)


@pytest.mark.parametrize("max_batch", [1, 4])
def test_stop_while_taking_the_next_job_hands_it_back(conn, redis_url, tiny, max_batch):
    # A stop landing as the worker takes its next job means "stop after the last
    # job": the job just taken is handed back unstarted, neither run nor stranded.
    from worker.lifecycle.held import Lifecycle
    from worker.runner import runtime as rt_mod
    from worker.runner.loop import Worker

    rt = rt_mod.WorkerRuntime(worker_id="sig")
    worker = Worker(conn, ["mlxq"], rt, name="sig", burst=True, max_batch=max_batch)
    real_take = Lifecycle.take
    takes = []

    def take(self, queues=None, block_s=0.0, **kw):
        found = real_take(self, queues, block_s, **kw)
        takes.append(found)
        if len(takes) == 2:  # as the second take's reply arrives
            worker.request_stop()
        return found

    worker.lifecycle.take = take.__get__(worker.lifecycle)
    s = Client(connection=conn).submit(
        [chat(tiny.target, max_tokens=2, temperature=0, seed=i + 1) for i in range(2)]
    )
    worker.work()
    assert len(takes) == 2 and takes[1] is not None
    assert one_result(conn, s.job_ids[0]).status == "succeeded"
    assert read_result(conn, s.job_ids[1]) is None
    assert conn.lrange(keys.rq_queue_key("mlxq"), 0, -1) == [s.job_ids[1].encode()]
    assert conn.hlen(keys.RUNNING) == 0
    assert conn.hget(keys.rq_job_key(s.job_ids[0]), "status") == b"finished"
    assert conn.hget(keys.rq_job_key(s.job_ids[1]), "status") == b"queued"
    assert conn.hget(worker.lifecycle.worker_key, "successful_job_count") == b"1"


def test_sigterm_while_idle_after_jobs_exits_at_once(conn, redis_url, tiny, workers):
    # After its jobs the worker waits in the dequeue (15 s with the default lease):
    # a SIGTERM must stop it now, not when that wait ends.
    w = workers("--max-batch", "1", name="after")
    s = Client(connection=conn).submit([chat(tiny.target, max_tokens=2)] * 2)
    assert Client(connection=conn).wait(s.batch_id, timeout=seconds(60)).done == 2
    wait_for(lambda: conn.hget("rq:worker:after", "state") == b"idle")
    time.sleep(0.5)  # most likely blocked in the dequeue wait (a stop before it ends alike)
    started = time.monotonic()
    w.signal(signal.SIGTERM)
    assert w.wait(30) == 0
    assert time.monotonic() - started < seconds(5)


@pytest.mark.parametrize(
    ("max_batch", "path"), [("1", "alone"), ("8", "batched"), ("8", "speculative, streamed")]
)
def test_a_load_slower_than_several_leases_keeps_the_job(conn, tiny, workers, max_batch, path):
    # Each model load takes 5 s longer (a hub download, a cold disk) against a 2 s
    # lease, on every path, with a second worker watching: the job runs once, on the
    # loading worker, with no crash counted and no requeue.
    spec = {"draft_model": tiny.twin, "num_draft_tokens": 2, "stream": True}
    extra = spec if path.startswith("spec") else {}
    s = Client(connection=conn).submit([chat(tiny.target, max_tokens=3, temperature=0, **extra)])
    job_id = s.job_ids[0]
    lease = ("--lease-seconds", "2", "--max-batch", max_batch)
    slow = workers(
        *lease,
        name="slow-loader",
        command=[sys.executable, "-m", "tests.slowload"],
        env={"MLXQ_TEST_SLOW_LOAD_S": "5"},
    )
    wait_for(lambda: conn.hexists(keys.RUNNING, job_id))
    other = workers(*lease, name="watcher")
    record = one_result(conn, job_id, timeout=120)
    assert record.status == "succeeded" and record.metrics.worker_id == "slow-loader"
    loads = 2 if extra else 1  # the target, and the draft
    assert record.metrics.load_time_s >= 5 * loads
    if extra:
        assert record.metrics.speculative and conn.xlen(keys.stream_key(job_id)) > 2
    assert conn.get(keys.crashes_key(job_id)) is None
    for w in (slow, other):  # (a worker still starting would die of the signal, not stop)
        w.serving()
        w.signal(signal.SIGTERM)
        assert w.wait() == 0
    assert "requeued" not in slow.output + other.output


def test_held_and_stranded_jobs_of_dead_workers_survive_rqs_cleanups(conn, tiny, workers):
    # One job is held by a worker that is then killed; another is stranded between
    # dequeue and start (in a dead worker's inbox). While the leases hold, and again once
    # they have ended, RQ's own cleanups run as they would beside mlxq (RQ's
    # intermediate-queue cleanup used to fail a stranded job seen there for a minute, and
    # its started-registry cleanup an expired one, behind mlxq's back): they touch
    # neither. RQ's minute is not waited out: the first-seen times it reads are set a
    # minute back. mlxq's recovery requeues both; each ends with one succeeded record.
    from rq import Queue, Worker
    from rq.registry import StartedJobRegistry
    from rq.serializers import JSONSerializer

    from worker.lifecycle.held import Lifecycle

    lease = round(seconds(10))  # the cleanups below run twice within it
    client = Client(connection=conn)
    held = client.submit([slow_job(tiny)]).job_ids[0]
    a = workers("--lease-seconds", str(lease), name="long-a")
    wait_for(lambda: running_execution(conn, held))
    a.signal(signal.SIGKILL)
    a.wait()
    killed = time.monotonic()
    stranded = client.submit([chat(tiny.target, max_tokens=2)]).job_ids[0]
    dead = Lifecycle(conn, "long-dead", ["mlxq"], lease_s=lease)
    dead.register()
    conn.blmove(keys.rq_queue_key("mlxq"), dead.inbox, 1, "LEFT", "RIGHT")
    assert conn.lrange(dead.inbox, 0, -1) == [stranded.encode()]
    queue = Queue("mlxq", connection=conn, serializer=JSONSerializer)
    rq_worker = Worker([queue], connection=conn, serializer=JSONSerializer, name="rq-cleaner")

    def rq_cleanups() -> None:
        rq_worker.clean_registries()  # RQ's intermediate-queue and registry cleanups
        StartedJobRegistry(queue=queue).get_job_ids()  # its started-registry cleanup
        info = [sys.executable, "-m", "rq.cli", "info", "--url", _url(conn)]
        subprocess.run(info, capture_output=True, check=True)

    rq_cleanups()  # (RQ notes when it first saw each id in its intermediate queue)
    for seen in conn.scan_iter("rq:queue:*:intermediate:first_seen:*"):
        conn.set(seen, time.time() - 120, keepttl=True)  # ... as if a minute ago
    rq_cleanups()
    assert time.monotonic() - killed < lease, "the cleanups ran after the leases ended"
    time.sleep(max(0.0, killed + lease + 1 - time.monotonic()))  # the leases end
    rq_cleanups()  # the leases have ended: still RQ fails nothing
    assert conn.hget(keys.rq_job_key(held), "status") == b"started"
    assert conn.zcard("rq:failed:mlxq") == 0
    assert read_result(conn, held) is None and read_result(conn, stranded) is None
    b = workers("--lease-seconds", str(lease), name="long-b")
    for job_id in (held, stranded):
        record = one_result(conn, job_id, timeout=120)
        assert record.status == "succeeded" and record.metrics.worker_id == "long-b"
    assert conn.get(keys.crashes_key(held)) == b"1"
    assert conn.zcard("rq:failed:mlxq") == 0
    b.signal(signal.SIGTERM)
    assert b.wait() == 0


def _url(conn: Redis) -> str:
    kw = conn.connection_pool.connection_kwargs
    return f"redis://{kw['host']}:{kw['port']}/0"
