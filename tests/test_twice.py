"""Every script is safe to run twice, as a retry after a lost reply runs it.

In a failover (or any dropped connection) a reply can be lost after Redis applied the
write; redis-py's Retry then sends the command, or the whole pipeline, again. ``Twice``
is a client that does exactly that for every script call, so each lifecycle step below
reaches Redis twice and the caller sees the second reply. The state (queues, holds,
records, and the counts a batch, RQ and the fleet report) must come out as if each
step ran once. The replies of a retried requeue, recovery or unregister list nothing
(the first call did it); the runner reads none of them, except recovery's "poison"
(a job to fail): lost, that job stays held until ``reconcile`` hands it back, and its
next crash makes it poison again. The take is the exception:
a second take starts a second job, and ``Lifecycle.reconcile`` hands that one back
(tests/test_lifecycle.py); here it is sent once.
"""

from __future__ import annotations

import hashlib
from typing import Any

from redis import Redis
from redis.client import Pipeline

from producer import Client
from producer.batches import batch_status, cancel_batch
from schemas import keys
from schemas.store import read_result, write_result
from tests.conftest import chat
from tests.test_lifecycle import expire, lifecycle, succeeded
from worker.lifecycle import scripts

TAKE_SHA = hashlib.sha1(scripts.TAKE.encode()).hexdigest()


def _doubled(args: tuple[Any, ...]) -> bool:
    name = str(args[0]).upper()
    if name == "EVALSHA":
        return args[1] != TAKE_SHA
    if name == "EVAL":
        return hashlib.sha1(str(args[1]).encode()).hexdigest() != TAKE_SHA
    return False


class TwicePipeline(Pipeline):
    def execute(self, raise_on_error: bool = True) -> list[Any]:
        stack = list(self.command_stack)
        first = super().execute(raise_on_error)
        if not any(_doubled(args) for args, _ in stack):
            return first
        self.command_stack = stack
        return super().execute(raise_on_error)


class Twice(Redis):
    """Sends every script call (but the take) twice and answers with the second reply."""

    sent_twice = 0

    def execute_command(self, *args: Any, **options: Any) -> Any:
        reply = super().execute_command(*args, **options)
        if not _doubled(args):
            return reply
        Twice.sent_twice += 1
        return super().execute_command(*args, **options)

    def pipeline(self, transaction: bool = True, shard_hint: Any = None) -> Pipeline:
        return TwicePipeline(self.connection_pool, self.response_callbacks, transaction, shard_hint)


def queued(conn: Redis) -> list[str]:
    return [j.decode() for j in conn.lrange(keys.rq_queue_key("mlxq"), 0, -1)]


def test_every_lifecycle_step_sent_twice_counts_once(redis_url, conn):
    twice = Twice.from_url(redis_url)
    sent = Twice.sent_twice
    client = Client(connection=twice)
    batch = client.submit([chat("some/model", content=f"job {i}") for i in range(6)])
    ids = batch.job_ids
    assert Twice.sent_twice > sent, "the enqueue was not sent twice"
    # Enqueued once: each id once on the queue and in the batch, the total 6.
    assert queued(conn) == ids and batch_status(conn, batch.batch_id).total == 6
    assert conn.llen(keys.batch_jobs_key(batch.batch_id)) == 6
    # The same file submitted again (a resumed submit) adds nothing either.
    again = client.submit(
        [chat("some/model", content=f"job {i}") for i in range(6)], batch_id=batch.batch_id
    )
    assert again.already_present == 6 and queued(conn) == ids

    a = lifecycle(twice, "a")
    b = lifecycle(twice, "b")
    held = [a.take() for _ in range(4)]
    assert a.renew() and b.renew()
    # Ended (the record, the batch counter, the done list, RQ's worker counter: once).
    assert a.end_many([(j, succeeded(j)) for j in held[:2]]) == [True, True]
    # Given back to the front once, not twice (the retry's reply says the hold was gone:
    # the runner does not read it).
    a.requeue(held[2])
    assert queued(conn)[:1] == [held[2].id] and queued(conn).count(held[2].id) == 1
    # A dead holder's job: requeued once, its crash counted once.
    lost = b.take()
    expire(twice, b)
    a.recover()  # the retry's reply lists nothing: the first pass did it all
    assert queued(conn).count(lost.id) == 1 and conn.get(keys.crashes_key(lost.id)) == b"1"
    # A record written by another writer (the gateway's, a poison record): once.
    assert write_result(twice, succeeded(held[3]), 60) is True
    assert a.end(held[3], succeeded(held[3])) is False  # it had its record
    # Everything left runs to its end.
    while (job := a.take()) is not None:
        a.end(job, succeeded(job))
    # A clean exit, with a job still held, hands it back once.
    late = client.submit([chat("some/model", content="late")])
    assert a.take().id == late.job_ids[0]
    a.unregister()
    assert queued(conn) == late.job_ids and conn.zscore(keys.LEASES, a.token) is None

    status = batch_status(conn, batch.batch_id)
    assert (status.total, status.succeeded, status.failed, status.running) == (6, 6, 0, 0)
    done = [j.decode() for j in conn.lrange(keys.batch_done_key(batch.batch_id), 0, -1)]
    assert sorted(done) == sorted(ids)
    assert all(read_result(conn, j).status == "succeeded" for j in ids)
    worker = conn.hgetall(keys.rq_worker_key("a"))
    assert int(worker[b"successful_job_count"]) == 6  # a ended each once
    assert conn.hlen(keys.RUNNING) == 0


def test_a_gateway_enqueue_sent_twice_is_accepted_even_when_the_queue_fills(redis_url, conn):
    """The interactive cap (``most``) is checked after the copy: a retry of an enqueue
    that went in answers with the total, not 'full', so the gateway does not answer
    429 for a job that will run."""
    from producer.enqueue import ENQUEUE_LUA, Prepared, enqueue_call

    twice = Twice.from_url(redis_url)
    script = twice.register_script(ENQUEUE_LUA)
    job_id = keys.job_id_for("chat_00000000000000000000", "chat")
    job = Prepared(job_id, "mlxq", b'{"x": 1}', "chat")
    script_keys, args = enqueue_call(keys.batch_of(job_id), [job], 60, 60, most=1)
    assert script(keys=script_keys, args=args) == 1
    assert queued(conn) == [job.job_id]


def test_a_cancel_sweep_sent_twice_drops_only_the_cancelled_batch(redis_url, conn):
    twice = Twice.from_url(redis_url)
    client = Client(connection=conn)
    kept = client.submit([chat("some/model", content="kept")])
    gone = client.submit([chat("some/model", content=f"gone {i}") for i in range(3)])
    more = client.submit([chat("some/model", content="more")])
    assert cancel_batch(twice, gone.batch_id) == (3, 0)
    # gone came while mlxq held kept's job: it waits on its own list, swept whole (once)
    assert queued(conn) == kept.job_ids
    assert conn.llen(keys.rq_queue_key(f"mlxq#{gone.batch_id}")) == 0
    a = lifecycle(twice)
    job = a.take()
    assert job.id == kept.job_ids[0] and a.take().id == more.job_ids[0]  # gone: dropped
    assert batch_status(conn, gone.batch_id).cancelled == 3
    assert batch_status(conn, more.batch_id).total == 1 and queued(conn) == []
