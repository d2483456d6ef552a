"""One Lua script's calls from concurrent requests, sent together on one connection.

redis-py's asyncio client gives each command in flight a connection of its own: 64
chat completions arriving at once open up to 64 Redis connections (a handshake each)
and pay the client's per-command cost 64 times, one after the other, while every
request waits. Here calls that come while a round trip is out wait for one sending
task, which sends all that wait as one pipeline per round trip: one write and one
read per round trip, on at most two connections (a lone call's and the pipeline's)
(OpenAI-style gateways see such bursts whenever a batch step ends many jobs at once
and their clients send the next requests in the same instant). A call that comes
while nothing is out is sent at once by its own request, with no hop through the
sending task: a lone request pays one round trip, as without coalescing.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
from typing import Any

from redis.asyncio import Redis as AsyncRedis
from redis.exceptions import NoScriptError

from schemas.connect import WAIT_TIMEOUT_MS, wait_for_replicas

log = logging.getLogger(__name__)

#: Most calls sent in one pipeline.
MOST = 512


class Coalesced:
    """``await script(keys=..., args=...)`` like redis-py's ``AsyncScript``, coalesced."""

    def __init__(self, conn: AsyncRedis, lua: str, wait_replicas: int = 0) -> None:
        self.conn, self.lua = conn, lua
        # After each pipeline: WAIT for this many replicas (``--wait-replicas``), and
        # the pipelines fewer acknowledged within WAIT_TIMEOUT_MS.
        self.wait_replicas, self.shortfalls = wait_replicas, 0
        self.sha = hashlib.sha1(lua.encode()).hexdigest()
        self._pending: list[tuple[list[str], list[Any], asyncio.Future[Any]]] = []
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._out = 0  # round trips in flight
        self.round_trips = 0

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def __call__(self, keys: list[str], args: list[Any]) -> Any:
        if not self._out and not self._pending:  # nothing out: no reason to wait
            self._out += 1
            try:
                return await self._direct(keys, args)
            finally:
                self._out -= 1
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._pending.append((keys, args, future))
        self._wake.set()
        return await future

    async def _direct(self, keys: list[str], args: list[Any]) -> Any:
        (reply,) = await self._send([(keys, args, None)])
        if isinstance(reply, Exception):
            raise reply
        return reply

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._pending:
                calls, self._pending = self._pending[:MOST], self._pending[MOST:]
                self._out += 1
                try:
                    replies = await self._send(calls)
                except Exception as e:  # anything: this task must outlive it
                    replies = [e] * len(calls)
                finally:
                    self._out -= 1
                for (_, _, future), reply in zip(calls, replies, strict=True):
                    if future.done():  # its request was cancelled meanwhile
                        continue
                    if isinstance(reply, Exception):
                        future.set_exception(reply)
                    else:
                        future.set_result(reply)

    async def _send(self, calls: list[tuple[list[str], list[Any], Any]]) -> list[Any]:
        replies = await self._pipeline(calls)
        if any(isinstance(r, NoScriptError) for r in replies):  # Redis restarted or flushed
            await self.conn.script_load(self.lua)
            again = [i for i, r in enumerate(replies) if isinstance(r, NoScriptError)]
            retried = await self._pipeline([calls[i] for i in again])
            for i, reply in zip(again, retried, strict=True):
                replies[i] = reply
        return replies

    async def _pipeline(self, calls: list[tuple[list[str], list[Any], Any]]) -> list[Any]:
        self.round_trips += 1
        async with self.conn.pipeline(transaction=False) as pipe:
            for keys, args, _ in calls:
                pipe.execute_command("EVALSHA", self.sha, len(keys), *keys, *args)
            if not self.wait_replicas:
                return list(await pipe.execute(raise_on_error=False))
            wait_for_replicas(pipe, self.wait_replicas)  # on the connection that wrote
            *replies, acked = await pipe.execute(raise_on_error=False)
        if isinstance(acked, Exception) or int(acked) < self.wait_replicas:
            self.shortfalls += 1
            log.warning(
                "%d job(s) reached %s of %d replica(s) within %d ms",
                len(calls),
                acked,
                self.wait_replicas,
                WAIT_TIMEOUT_MS,
            )
        return replies
