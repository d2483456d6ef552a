"""The gateway's record notices: one reader per process, fed by every record writer.

Real Redis, the real enqueue script, the worker's real end-of-job script
(``Lifecycle.end_many``) and the shared write-once script (``write_result``).
"""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from redis import Redis
from redis.asyncio import Redis as AsyncRedis

from producer.enqueue import ENQUEUE_LUA
from producer.serve import chat, notify
from producer.serve.notify import Notifier
from producer.serve.settings import GatewaySettings
from schemas import ResultRecord, keys
from schemas.store import write_result
from tests.conftest import chat as chat_body
from tests.test_lifecycle import succeeded
from tests.waiting import seconds
from worker.lifecycle.held import Lifecycle

SETTINGS = GatewaySettings(chat_ttl=600)


def calls(conn: Redis, command: str) -> int:
    return int(conn.info("commandstats").get(f"cmdstat_{command}", {}).get("calls", 0))


async def enqueue_chats(aredis: AsyncRedis, n: int, notifier: Notifier | None) -> list[str]:
    """``n`` chat jobs as the gateway enqueues them (naming ``notifier``'s list)."""
    script = aredis.register_script(ENQUEUE_LUA)
    ids = [chat.new_job_id() for _ in range(n)]
    for job_id in ids:
        body = chat_body("tiny", max_tokens=2)
        assert await chat.enqueue(script, job_id, body, SETTINGS, notifier.key if notifier else "")
    return ids


def enqueued(redis_url: str, n: int) -> list[str]:
    """``n`` chat jobs whose batches name no listener."""

    async def enqueue() -> list[str]:
        aredis = AsyncRedis.from_url(redis_url)
        out = await enqueue_chats(aredis, n, None)
        await aredis.aclose()
        return out

    return asyncio.run(enqueue())


def record_for(job_id: str) -> ResultRecord:
    return ResultRecord(
        job_id=job_id,
        batch_id=keys.batch_of(job_id),
        custom_id="chat",
        status="succeeded",
        finished_at=time.time(),
    )


def test_a_worker_step_ending_64_jobs_wakes_the_gateway_once(redis_url, conn):
    """64 chat jobs, taken and ended by the worker's lifecycle in one round trip: every
    waiting future gets its own record, read with a handful of commands, not 64 x 2."""

    async def scenario() -> dict[str, bytes]:
        aredis = AsyncRedis.from_url(redis_url)
        notifier = Notifier(aredis)
        ids = await enqueue_chats(aredis, 64, notifier)
        futures = {i: notifier.expect(i, 60, Connected()) for i in ids}
        life = Lifecycle(Redis.from_url(redis_url), "w", [keys.INTERACTIVE_QUEUE])
        held = [life.take() for _ in ids]
        assert all(h is not None for h in held)
        before = {c: calls(conn, c) for c in ("blpop", "lpop", "get", "mget")}
        notifier.start()
        await asyncio.sleep(0.2)  # the reader is waiting when the step ends
        life.end_many([(h, succeeded(h)) for h in held])
        _, pending = await asyncio.wait(futures.values(), timeout=seconds(10))
        assert not pending, f"{len(pending)} records never noticed"
        await notifier.stop()
        after = {c: calls(conn, c) - before[c] for c in before}
        # One pop brings all 64 (a few more while idle), no record read one by one.
        assert after["blpop"] + after["lpop"] <= 8 and after["get"] + after["mget"] == 0, after
        await aredis.aclose()
        return {i: f.result() for i, f in futures.items()}

    got = asyncio.run(scenario())
    assert len(got) == 64
    for job_id, record in got.items():
        assert record is not None and record["job_id"] == job_id
        assert record == json.loads(conn.get(keys.result_key(job_id)))


def test_every_record_writer_notifies_and_unknown_ids_are_ignored(redis_url, conn):
    """Records written through the shared write-once script (recovery's and refusals'
    path) notify too; ids nobody waits for any more are dropped, not kept."""

    async def scenario() -> None:
        aredis = AsyncRedis.from_url(redis_url)
        notifier = Notifier(aredis)
        notifier.start()
        waited, gone = await enqueue_chats(aredis, 2, notifier)
        future = notifier.expect(waited, 60, Connected())
        abandoned = notifier.expect(gone, 60, Connected())
        notifier.forget(gone)  # its request ended
        write_result(conn, record_for(gone), 600)
        write_result(conn, record_for(waited), 600)
        record = await asyncio.wait_for(future, seconds(10))
        assert record is not None and record["job_id"] == waited
        await asyncio.sleep(0.2)
        assert not abandoned.done() and notifier.waiting == 1
        assert conn.llen(notifier.key) == 0  # both popped: nothing piles up
        await notifier.stop()
        await aredis.aclose()

    asyncio.run(scenario())


def test_only_batches_naming_a_listener_push_and_a_gone_listener_is_not_kept(redis_url, conn):
    (plain,) = enqueued(redis_url, 1)
    assert not conn.hexists(keys.batch_key(keys.batch_of(plain)), "notify")
    assert write_result(conn, record_for(plain), 600)
    assert conn.keys(keys.notify_key("*")) == []

    async def named() -> tuple[str, str]:  # a gateway that enqueued, then died
        aredis = AsyncRedis.from_url(redis_url)
        notifier = Notifier(aredis)
        (job_id,) = await enqueue_chats(aredis, 1, notifier)
        await aredis.aclose()
        return job_id, notifier.key

    job_id, key = asyncio.run(named())
    assert write_result(conn, record_for(job_id), 600)
    assert json.loads(conn.lindex(key, 0))["job_id"] == job_id
    assert 0 < conn.ttl(key) <= keys.NOTIFY_TTL < 600


@pytest.mark.parametrize("target", ["mlxq:running", "mlxq:notify:taken"])
def test_a_hostile_notify_field_cannot_stop_a_record(redis_url, conn, target):
    """A batch hash whose ``notify`` names a key outside the notify lists, or a notify key
    of another type: the record is written, the job ends, the other key is untouched."""
    conn.set("mlxq:notify:taken", "a string, not a list")
    conn.hset(keys.RUNNING, "someone-else", "token q")

    (job_id,) = enqueued(redis_url, 1)
    conn.hset(keys.batch_key(keys.batch_of(job_id)), "notify", target)
    life = Lifecycle(Redis.from_url(redis_url), "w", [keys.INTERACTIVE_QUEUE])
    held = life.take()
    assert held is not None and held.id == job_id
    assert life.end_many([(held, succeeded(held))]) == [True]
    assert json.loads(conn.get(keys.result_key(job_id)))["status"] == "succeeded"
    assert not conn.hexists(keys.RUNNING, job_id)
    assert conn.type(keys.RUNNING) == b"hash" and conn.hlen(keys.RUNNING) == 1
    assert conn.get("mlxq:notify:taken") == b"a string, not a list"


def test_a_lost_notice_costs_seconds_not_the_answer(redis_url, conn, monkeypatch):
    """A record whose notice never comes (its batch names no listener) is read by the
    sweep after FALLBACK_S; waits whose client went away or whose time ran out end
    with None within a sweep, and their unstarted jobs are cancelled."""
    monkeypatch.setattr(notify, "FALLBACK_S", 2.0)
    monkeypatch.setattr(notify, "SWEEP_S", 0.25)

    async def scenario() -> tuple[list[dict | None], list[float]]:
        aredis = AsyncRedis.from_url(redis_url)
        notifier = Notifier(aredis)
        notifier.start()
        lost, gone, late = ids
        left = Connected()
        futures = [
            notifier.expect(lost, 60, Connected()),
            notifier.expect(gone, 60, left),
            notifier.expect(late, 0.5, Connected()),
        ]
        write_result(conn, record_for(lost), 600)
        start, took = time.monotonic(), []

        async def wait(job_id: str, future: asyncio.Future) -> dict | None:
            record = await chat.wait_record(aredis, notifier, future, job_id, ttl=600)
            took.append(time.monotonic() - start)
            return record

        waits = [wait(j, f) for j, f in zip((lost, gone, late), futures, strict=True)]
        left.connected = False
        records = await asyncio.wait_for(asyncio.gather(*waits), seconds(30))
        assert notifier.waiting == 0
        await notifier.stop()
        await aredis.aclose()
        return records, took

    ids = enqueued(redis_url, 3)
    lost, gone, late = ids
    records, took = asyncio.run(scenario())
    assert records[0] is not None and records[0]["status"] == "succeeded"
    assert records[1] is None and records[2] is None
    assert max(took) < seconds(10) and sorted(took)[-1] >= 1.5  # the lost one waited for the read
    batches = [keys.batch_key(keys.batch_of(j)) for j in (lost, gone, late)]
    assert [conn.hexists(b, "cancelled_at") for b in batches] == [False, True, True]


class Connected:
    """A client, as far as a wait is concerned (Starlette's Request in the gateway)."""

    def __init__(self) -> None:
        self.connected = True

    async def is_disconnected(self) -> bool:
        return not self.connected
