"""The job lifecycle against a real Redis: transitions, leases, recovery, and RQ's view of it.

No models here: jobs are taken and ended by hand, as the worker loop does.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest
from rq import Queue, Worker
from rq.job import Job
from rq.registry import FailedJobRegistry, FinishedJobRegistry, StartedJobRegistry
from rq.serializers import JSONSerializer
from rq.suspension import resume, suspend

from producer import Client
from schemas import GenerationError, ResultRecord, keys
from schemas.store import read_result, write_result
from tests.conftest import chat
from tests.waiting import seconds
from worker.lifecycle import registry
from worker.lifecycle.held import Job as HeldJob
from worker.lifecycle.held import Lifecycle, Refused


def lifecycle(conn, name="w", queues=("mlxq",), **kw) -> Lifecycle:
    """A registered lifecycle, with RQ's worker record, as the worker loop starts it."""
    lc = Lifecycle(conn, name, list(queues), **kw)
    lc.register()
    registry.rq_birth(conn, name, list(queues), lc.worker_ttl)
    return lc


def submit(conn, n=1, batch_id=None) -> list[str]:
    bodies = [chat("some/model", content=f"job {i}") for i in range(n)]
    return Client(connection=conn).submit(bodies, batch_id=batch_id).job_ids


def succeeded(job: HeldJob) -> ResultRecord:
    return ResultRecord(
        job_id=job.id,
        batch_id=job.envelope.batch_id,
        custom_id=job.envelope.custom_id,
        status="succeeded",
        finished_at=time.time(),
    )


def expire(conn, lc: Lifecycle) -> None:
    """As if the process holding ``lc``'s lease had died a lease ago."""
    conn.zadd(keys.LEASES, {lc.token: 0})


def rq_queue(conn) -> Queue:
    return Queue("mlxq", connection=conn, serializer=JSONSerializer)


def test_a_taken_job_is_started_where_rq_and_rq_info_see_it(conn, redis_url):
    (job_id,) = submit(conn)
    lc = lifecycle(conn, "mini-1")
    job = lc.take()
    assert isinstance(job, HeldJob) and job.id == job_id and job.queue == "mlxq"
    rq_job = Job.fetch(job_id, connection=conn, serializer=JSONSerializer)
    assert rq_job.get_status() == "started" and rq_job.worker_name == "mini-1"
    assert StartedJobRegistry(queue=rq_queue(conn)).get_job_ids() == [job_id]
    (rq_worker,) = Worker.all(connection=conn)
    assert (rq_worker.name, rq_worker.get_state(), rq_worker.get_current_job_id()) == (
        "mini-1",
        "busy",
        job_id,
    )
    assert rq_worker.queue_names() == ["mlxq"]
    info = subprocess.run(
        [sys.executable, "-m", "rq.cli", "info", "--url", redis_url],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "mini-1" in info and "mlxq" in info
    assert rq_job.args[0]["request"]["messages"]
    assert lc.end(job, succeeded(job)) is True
    assert rq_job.get_status(refresh=True) == "finished"
    # The request is dropped once the record holds the answer; RQ still reads the hash.
    assert Job.fetch(job_id, connection=conn, serializer=JSONSerializer).args == []
    assert FinishedJobRegistry(queue=rq_queue(conn)).get_job_ids() == [job_id]
    assert StartedJobRegistry(queue=rq_queue(conn)).get_job_ids() == []
    assert conn.hlen(keys.RUNNING) == 0
    assert read_result(conn, job_id).status == "succeeded"
    (rq_worker,) = Worker.all(connection=conn)
    assert rq_worker.successful_job_count == 1
    assert lc.take() is None
    assert Worker.all(connection=conn)[0].get_state() == "idle"
    lc.unregister()
    registry.rq_death(conn, "mini-1", ["mlxq"])
    assert Worker.all(connection=conn) == []


def test_a_failed_job_shows_in_rqs_failed_registry_with_its_error(conn):
    (job_id,) = submit(conn)
    lc = lifecycle(conn)
    job = lc.take()
    error = GenerationError("the batch broke")
    lc.end(job, ResultRecord.failed(job.id, job.envelope.batch_id, "c", error))
    rq_job = Job.fetch(job_id, connection=conn, serializer=JSONSerializer)
    assert rq_job.get_status() == "failed"
    assert rq_job.args[0]["custom_id"]  # a failed job keeps its request, to look into
    assert rq_job.latest_result().exc_string == "the batch broke"
    assert FailedJobRegistry(queue=rq_queue(conn)).get_job_ids() == [job_id]
    assert read_result(conn, job_id).error.code == "generation_error"


def test_ending_jobs_takes_one_round_trip_and_survives_a_flushed_script(conn):
    """No ``SCRIPT EXISTS`` before each end (a second round trip on every job's end);
    a script Redis lost (restarted, flushed) is loaded again and the end goes through."""
    ids = submit(conn, 3)
    lc = lifecycle(conn)
    jobs = [lc.take() for _ in ids]
    lc.end(jobs[0], succeeded(jobs[0]))  # the first end may load the script
    stats = conn.info("commandstats")
    before = {
        c: stats.get(f"cmdstat_{c}", {}).get("calls", 0) for c in ("script|exists", "evalsha")
    }
    assert lc.end(jobs[1], succeeded(jobs[1])) is True
    stats = conn.info("commandstats")
    after = {c: stats.get(f"cmdstat_{c}", {}).get("calls", 0) for c in ("script|exists", "evalsha")}
    assert after == {"script|exists": before["script|exists"], "evalsha": before["evalsha"] + 1}
    conn.script_flush()
    assert lc.end(jobs[2], succeeded(jobs[2])) is True
    assert [read_result(conn, i).status for i in ids] == ["succeeded"] * 3
    assert conn.hlen(keys.RUNNING) == 0
    assert FinishedJobRegistry(queue=rq_queue(conn)).get_job_ids() == ids


def test_rqs_cleanups_never_fail_a_held_job(conn):
    (job_id,) = submit(conn)
    lc = lifecycle(conn, lease_s=2)
    job = lc.take()
    far = time.time() + 10**7
    StartedJobRegistry(queue=rq_queue(conn)).cleanup(timestamp=far)
    Worker([rq_queue(conn)], connection=conn, serializer=JSONSerializer).clean_registries()
    assert Job.fetch(job_id, connection=conn, serializer=JSONSerializer).get_status() == "started"
    assert conn.hexists(keys.RUNNING, job_id)
    assert FailedJobRegistry(queue=rq_queue(conn)).get_job_ids() == []
    assert lc.end(job, succeeded(job)) is True


def test_leases_run_on_redis_clock(conn):
    lc = lifecycle(conn, lease_s=7)
    seconds, micros = conn.time()
    now_ms = seconds * 1000 + micros // 1000
    assert now_ms + 6000 < conn.zscore(keys.LEASES, lc.token) <= now_ms + 7000


def test_a_dead_holders_job_is_requeued_then_poisoned_at_the_limit(conn, caplog):
    (job_id,) = submit(conn)
    other = submit(conn)[0]
    a = lifecycle(conn, "a", max_crashes=2)
    assert a.take().id == job_id
    b = lifecycle(conn, "b", max_crashes=2)
    expire(conn, a)
    assert [(r.kind, r.job_id, r.crashes) for r in b.recover()] == [("requeued", job_id, 1)]
    # The log counts against --max-crashes as its help says (the 2nd crash fails it).
    assert "crash 1 of 2 (--max-crashes; crash 2 fails it as poison)" in caplog.text
    assert conn.lrange(keys.rq_queue_key("mlxq"), 0, -1) == [job_id.encode()]  # its front
    # (other's batch came while mlxq held work: it waits on its own list, taking turns)
    other_list = keys.rq_queue_key(f"mlxq#{keys.batch_of(other)}")
    assert conn.lrange(other_list, 0, -1) == [other.encode()]
    assert conn.hget(keys.rq_job_key(job_id), "status") == b"queued"
    assert StartedJobRegistry(queue=rq_queue(conn)).get_job_ids() == []
    assert not conn.exists(a.inbox) and conn.zscore(keys.LEASES, a.token) is None
    assert b.take().id == job_id  # first in line again
    expire(conn, b)
    c = Lifecycle(conn, "c", ["mlxq"], max_crashes=2)
    c.register()  # its first recovery pass: the second crash reaches the limit
    assert c.recover() == []
    record = read_result(conn, job_id)
    assert record.status == "failed" and record.error.code == "poison_job"
    assert "died 2 times" in record.error.message and record.custom_id == "req-1"
    assert conn.hlen(keys.RUNNING) == 0
    assert FailedJobRegistry(queue=rq_queue(conn)).get_job_ids() == [job_id]


def test_a_dead_holders_job_that_has_its_record_is_not_run_again(conn):
    (job_id,) = submit(conn)
    a = lifecycle(conn, "a")
    job = a.take()
    write_result(conn, succeeded(job), 60)  # it wrote its record, then died
    expire(conn, a)
    b = lifecycle(conn, "b")
    assert [r.kind for r in b.recover()] == []  # b's register() already recovered it
    assert conn.hget(keys.rq_job_key(job_id), "status") == b"finished"
    assert conn.llen(keys.rq_queue_key("mlxq")) == 0 and conn.hlen(keys.RUNNING) == 0
    assert conn.get(keys.crashes_key(job_id)) is None


def test_copies_of_a_held_or_finished_job_are_dropped(conn):
    (job_id,) = submit(conn)
    a, b = lifecycle(conn, "a"), lifecycle(conn, "b")
    job = a.take()
    conn.rpush(keys.rq_queue_key("mlxq"), job_id)
    assert b.take() is None  # held by a right now: this copy is dropped
    assert conn.llen(keys.rq_queue_key("mlxq")) == 0
    a.end(job, succeeded(job))
    conn.rpush(keys.rq_queue_key("mlxq"), job_id)
    assert b.take() is None  # it has its record
    assert read_result(conn, job_id).status == "succeeded"
    assert conn.hget(keys.batch_key(job.envelope.batch_id), "succeeded") == b"1"


def test_a_stalled_worker_learns_its_lease_ended_and_its_late_end_leaves_the_new_holder_alone(
    conn,
):
    (job_id,) = submit(conn)
    a = lifecycle(conn, "a")
    job = a.take()
    expire(conn, a)
    b = lifecycle(conn, "b")  # recovers a's job on start
    assert a.renew() is False and a.renew() is True  # a goes on under a fresh lease
    again = b.take()
    assert again.id == job_id
    assert a.end(job, succeeded(job)) is True  # first write wins
    assert conn.hget(keys.RUNNING, job_id).decode().startswith(b.token)
    assert b.end(again, succeeded(again)) is False
    assert conn.hlen(keys.RUNNING) == 0


def test_requeue_and_unregister_give_jobs_back_to_the_front(conn):
    first, second, third = submit(conn, 3)
    lc = lifecycle(conn)
    job = lc.take()
    assert lc.requeue(job) is True and lc.requeue(job) is False
    assert conn.lrange(keys.rq_queue_key("mlxq"), 0, 0) == [first.encode()]
    assert conn.hget(keys.rq_job_key(first), "status") == b"queued"
    assert lc.take().id == first
    conn.blmove(keys.rq_queue_key("mlxq"), lc.inbox, 1, "LEFT", "RIGHT")  # second, waiting
    assert sorted(lc.unregister()) == sorted([first, second])
    queued = [j.decode() for j in conn.lrange(keys.rq_queue_key("mlxq"), 0, -1)]
    assert sorted(queued[:2]) == sorted([first, second]) and queued[2] == third
    assert conn.zcard(keys.LEASES) == 0 and conn.hlen(keys.HOLDERS) == 0
    assert conn.hlen(keys.RUNNING) == 0


def test_a_take_whose_reply_was_lost_is_handed_back_by_reconcile(conn):
    # A take applied twice (its first reply lost in a failover, then retried): Redis
    # lists two jobs as held by this process, which runs one. Recovery never frees the
    # other (the lease is alive); reconcile does, once two passes in a row see it.
    first, second = submit(conn, 2)
    lc = lifecycle(conn)
    running = lc.take()
    lost = lc.take()
    lc._released(lost.id)  # as if its reply never came back
    assert lc.reconcile() == []  # first sighting: perhaps a take in flight
    assert lc.reconcile() == [lost.id]
    assert conn.lrange(keys.rq_queue_key("mlxq"), 0, -1) == [lost.id.encode()]
    assert conn.hget(keys.rq_job_key(lost.id), "status") == b"queued"
    assert lc.reconcile() == [] and lc.end(running, succeeded(running))
    again = lc.take()
    assert again.id == lost.id and again.id in lc.holding
    assert lc.reconcile() == [] and lc.reconcile() == []  # held and running: left alone
    assert lc.end(again, succeeded(again)) and lc.holding == set()
    assert {running.id, again.id} == {first, second} and conn.hlen(keys.RUNNING) == 0


def test_rq_suspend_holds_takes(conn):
    submit(conn)
    lc = lifecycle(conn)
    suspend(conn)
    assert lc.take() is None
    assert conn.llen(keys.rq_queue_key("mlxq")) == 1
    resume(conn)
    assert isinstance(lc.take(), HeldJob)


def test_a_blocking_take_waits_for_a_job(conn):
    lc = lifecycle(conn)
    started = time.monotonic()
    assert lc.take(block_s=0.3) is None
    assert time.monotonic() - started >= 0.25
    submit(conn)
    assert isinstance(lc.take(block_s=5), HeldJob)


def _hostile_hashes(conn) -> dict[str, str]:
    """Job ids of one hash of each kind a worker must refuse, queued on ``mlxq``."""
    import pickle
    import zlib

    ok_id, cb_id = submit(conn, 2, batch_id="hostile")
    conn.hset(keys.rq_job_key(cb_id), "success_callback_name", "os.system")
    q = rq_queue(conn)
    q.enqueue("os.system", "true", job_id="other-fn")
    bad = {"job_id": "bad-env", "batch_id": "hostile", "custom_id": "x", "request": {}}
    q.enqueue(keys.JOB_FUNCTION, bad, job_id="bad-env")
    pickled = zlib.compress(pickle.dumps((keys.JOB_FUNCTION, None, ({},), {})))
    conn.hset(keys.rq_job_key("pickled"), mapping={"data": pickled, "status": "queued"})
    conn.rpush(keys.rq_queue_key("mlxq"), "pickled", "ghost")
    conn.lrem(keys.rq_queue_key("mlxq"), 1, ok_id)
    return {"callbacks": cb_id, "other": "other-fn", "invalid": "bad-env", "pickled": "pickled"}


def test_each_kind_of_hostile_hash_is_refused(conn):
    ids = _hostile_hashes(conn)
    lc = lifecycle(conn)
    refused = {}
    while (got := lc.take()) is not None:
        assert isinstance(got, Refused), got
        refused[got.id] = got.refusal.kind
        lc.refuse(got)
    assert refused == {
        ids["callbacks"]: "unsafe",
        "other-fn": "unsafe",
        "bad-env": "invalid",
        "pickled": "corrupt",
        "ghost": "missing",
    }
    cb = read_result(conn, ids["callbacks"])  # an mlxq job of a known batch: it gets a record
    assert cb.error.code == "unsafe_job" and "success_callback_name" in cb.error.message
    assert cb.custom_id == "req-2"
    bad = read_result(conn, "bad-env")
    assert bad.error.code == "invalid_request" and bad.status_code == 400
    dead = {e["job_id"] for e in map(_json, conn.lrange(keys.DEAD_LETTERS, 0, -1))}
    assert dead == {ids["callbacks"], "other-fn", "pickled", "ghost"}
    assert conn.hlen(keys.RUNNING) == 0
    for job_id in (ids["callbacks"], "other-fn", "pickled"):
        assert conn.hget(keys.rq_job_key(job_id), "status") == b"failed"


def _json(raw: bytes) -> dict:
    import json

    return json.loads(raw)


@pytest.mark.parametrize("n", [0, 3])
def test_recovery_with_nothing_dead_changes_nothing(conn, n):
    submit(conn, n + 1)
    lc = lifecycle(conn)
    held = [lc.take() for _ in range(n)]
    before = (conn.hgetall(keys.RUNNING), conn.lrange(keys.rq_queue_key("mlxq"), 0, -1))
    assert lc.recover() == []
    assert (conn.hgetall(keys.RUNNING), conn.lrange(keys.rq_queue_key("mlxq"), 0, -1)) == before
    assert len(held) == n


def test_expired_registry_entries_are_pruned_in_bounded_steps(conn):
    """RQ's finished / failed registries lose entries whose job hashes expired (nothing
    else removes them), a bounded number per script call; live entries stay."""
    lc = lifecycle(conn)
    finished, failed = keys.rq_finished_key("mlxq"), keys.rq_failed_key("mlxq")
    now = int(time.time())
    conn.zadd(finished, {f"old-{i}": now - 10 for i in range(25)} | {"live": now + 3600})
    conn.zadd(failed, {f"gone-{i}": now - 10 for i in range(7)})
    assert lc.prune(step=10, most=1) == 17  # 10 + 7: one call, at most 10 per registry
    assert conn.zcard(finished) == 16
    assert lc.prune(step=10) == 15
    assert conn.zrange(finished, 0, -1) == [b"live"] and conn.zcard(failed) == 0
    (job_id,) = submit(conn)
    job = lc.take()
    lc.end(job, succeeded(job))
    assert lc.prune() == 0 and conn.zscore(finished, job_id) > now  # kept for its TTL


@pytest.mark.parametrize("tenant", [keys.DEFAULT_TENANT, "team-a"])
def test_an_idle_worker_starts_a_job_on_any_queue_it_serves_at_once(conn, tenant):
    """An idle worker blocks on its queues' wake list, which every enqueue feeds: a job on
    its second queue (or a tenant's list of it) starts within milliseconds, not when a
    wait on the first queue times out (BLOCK_S)."""
    lc = lifecycle(conn, queues=(keys.INTERACTIVE_QUEUE, "mlxq"))
    got: list = []

    def take() -> None:
        got.append(lc.take(block_s=5))
        got.append(time.monotonic())

    for _ in range(3):
        got.clear()
        waiter = threading.Thread(target=take)
        waiter.start()
        time.sleep(0.3)  # idle, blocked
        sent = time.monotonic()
        bodies = [chat("some/model", content="wake")]
        (job_id,) = Client(connection=conn).submit(bodies, tenant=tenant).job_ids
        waiter.join(seconds(5))
        job, at = got
        assert job is not None and job.id == job_id
        # (not woken, it would start when its 5 s wait on the first queue ended)
        assert at - sent < min(seconds(0.2), 2.5), f"started {at - sent:.2f} s after it was queued"
        lc.end(job, succeeded(job))
    assert conn.llen(keys.wake_key("mlxq")) <= 64  # tokens stay bounded
