"""The gateway's coalesced script calls: concurrent enqueues share round trips (real Redis)."""

from __future__ import annotations

import asyncio

from redis import Redis
from redis.asyncio import Redis as AsyncRedis

from producer.enqueue import ENQUEUE_LUA
from producer.serve import chat
from producer.serve.coalesce import Coalesced
from schemas import keys
from tests.test_notify import SETTINGS, calls
from tests.test_notify import chat_body as body
from tests.waiting import seconds

#: A script that fails for a key of the wrong type and echoes otherwise.
ECHO_LUA = "redis.call('INCR', KEYS[1]); return ARGV[1]"


def test_a_burst_of_64_enqueues_takes_a_few_round_trips_and_two_connections_at_most(
    redis_url, conn
):
    async def scenario() -> tuple[list[bool], int, int, int]:
        # Named, so that connections other tests on this Redis left open do not count.
        aredis = AsyncRedis.from_url(redis_url, client_name="burst-gateway")
        script = Coalesced(aredis, ENQUEUE_LUA)
        script.start()
        ids = [chat.new_job_id() for _ in range(64)]
        before = calls(conn, "evalsha")
        answers = await asyncio.gather(
            *(chat.enqueue(script, i, body("tiny", max_tokens=2), SETTINGS) for i in ids)
        )
        sent = calls(conn, "evalsha") - before
        clients = sum(c.get("name") == "burst-gateway" for c in conn.client_list())
        await script.stop()
        await aredis.aclose()
        return answers, script.round_trips, sent, clients

    answers, round_trips, sent, clients = asyncio.run(scenario())
    assert answers == [True] * 64
    assert sent >= 64 and round_trips <= 4, round_trips  # 1 alone, then the rest together
    assert clients <= 2, clients  # the first call's own, and the pipeline's meanwhile
    assert conn.llen(keys.rq_queue_key(keys.INTERACTIVE_QUEUE)) == 64


def test_one_failing_call_fails_alone_and_a_flushed_script_is_loaded_again(redis_url, conn):
    conn.hset("not-a-counter", "a", "b")

    async def scenario() -> list[object]:
        aredis = AsyncRedis.from_url(redis_url)
        script = Coalesced(aredis, ECHO_LUA)
        script.start()
        first = await script(keys=["n"], args=["warm"])
        conn.script_flush()  # Redis restarted: the script must be loaded again
        got = await asyncio.gather(
            *(script(keys=[k], args=[k]) for k in ("n", "not-a-counter", "m")),
            return_exceptions=True,
        )
        await script.stop()
        await aredis.aclose()
        return [first, *got]

    first, ok, bad, other = asyncio.run(scenario())
    assert first == b"warm" and ok == b"n" and other == b"m"
    assert isinstance(bad, Exception) and "WRONGTYPE" in str(bad)
    assert Redis.from_url(redis_url).get("n") == b"2"


def test_a_lone_call_goes_at_once_without_the_sending_task(redis_url):
    """Nothing out: the request sends its own call (no hop through the task, which is
    not even started here); a call that comes while it is out waits for the task."""

    async def scenario() -> tuple[object, bool]:
        aredis = AsyncRedis.from_url(redis_url)
        script = Coalesced(aredis, ECHO_LUA)
        lone = await asyncio.wait_for(script(keys=["n"], args=["alone"]), seconds(5))
        first = asyncio.ensure_future(script(keys=["n"], args=["a"]))
        await asyncio.sleep(0)  # the first is out
        second = asyncio.ensure_future(script(keys=["n"], args=["b"]))
        await asyncio.wait_for(asyncio.shield(first), seconds(5))  # its own call came back
        waited = not second.done()  # (its reply is the task's to send)
        script.start()  # now the task sends what waits
        await asyncio.wait_for(second, seconds(5))
        await script.stop()
        await aredis.aclose()
        return lone, waited

    lone, waited = asyncio.run(scenario())
    assert lone == b"alone"
    assert waited
