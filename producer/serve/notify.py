"""Bringing chat completions their records: one Redis reader per gateway process.

Each gateway process has its own notify list (``schemas.keys.notify_key``); the chat
batches it enqueues name it (batch hash field ``notify``), and the write-once script
every record writer runs (worker, recovery, refusals: ``schemas.store``) pushes the
record there too. One task pops the list (everything queued in one ``LPOP``, else one
blocking ``BLPOP``) and hands each record to the request waiting for it. So a process
holds one waiting connection however many requests wait, a batch step that ends 64
jobs costs the gateway one read instead of 128 (a ``BLPOP`` and a ``GET`` each), and
a waiting request is resumed straight from the reader, with no timer of its own.

One sweep a second ends the waits of requests whose client went away or whose time
is up (they get None), and every :data:`FALLBACK_S` it reads the records of all
requests still waiting with one ``MGET``: a notice lost (the reader's connection
dropped mid-read, a gateway restarted its reader) costs seconds, never the answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
from dataclasses import dataclass
from typing import Any, Protocol

from redis.asyncio import Redis as AsyncRedis

from schemas import keys

log = logging.getLogger(__name__)

#: Longest single blocking pop (seconds): how soon an idle reader notices it is stopped.
POP_S = 1
#: Records taken per pop.
POP_MOST = 1000
#: How often waits are checked for gone clients and deadlines (seconds).
SWEEP_S = 1.0
#: How often the records of requests still waiting are read directly (seconds).
FALLBACK_S = 5.0

Record = dict[str, Any]


class Client(Protocol):
    """What a wait needs of its HTTP request (Starlette's ``Request`` has it)."""

    async def is_disconnected(self) -> bool: ...


@dataclass
class _Wait:
    future: asyncio.Future[Record | None]
    deadline: float  # event loop time
    client: Client


class Notifier:
    """Futures for records, resolved by one reader of this process's notify list."""

    def __init__(self, conn: AsyncRedis) -> None:
        self.conn = conn
        self.key = keys.notify_key(secrets.token_hex(8))
        self._waits: dict[str, _Wait] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._stopping = False

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._read()), loop.create_task(self._sweep())]

    async def stop(self) -> None:
        self._stopping = True  # redis-py may turn the cancellation into a connection error
        for task in self._tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def expect(
        self, job_id: str, timeout_s: float, client: Client
    ) -> asyncio.Future[Record | None]:
        """A future for ``job_id``'s record: the record, or None once ``client`` went away
        or ``timeout_s`` passed. Call it before enqueueing the job (a notice must not come
        before anyone expects it) and :meth:`forget` the job once done with it."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Record | None] = loop.create_future()
        self._waits[job_id] = _Wait(future, loop.time() + timeout_s, client)
        return future

    def forget(self, job_id: str) -> None:
        self._waits.pop(job_id, None)

    @property
    def waiting(self) -> int:
        return len(self._waits)

    def _resolve(self, job_id: str, record: Record | None) -> None:
        wait = self._waits.get(job_id)
        if wait is not None and not wait.future.done():
            wait.future.set_result(record)

    async def _read(self) -> None:
        while not self._stopping:
            try:
                for raw in await self._pop():
                    try:
                        record = json.loads(raw)
                        self._resolve(record["job_id"], record)
                    except (ValueError, KeyError, TypeError):  # not a record: no one waits
                        log.warning("notify list %s: an entry that is not a record", self.key)
            except Exception as e:  # Redis restarting, say: the sweep's reads cover it
                if self._stopping:
                    return
                log.warning("notify reader: %s; retrying", type(e).__name__)
                await asyncio.sleep(0.5)

    async def _pop(self) -> list[bytes]:
        """What the list holds now, or else the first record to come within POP_S."""
        if got := await self.conn.lpop(self.key, POP_MOST):
            return list(got)
        popped = await self.conn.blpop([self.key], timeout=POP_S)
        return [popped[1]] if popped else []

    async def _sweep(self) -> None:
        loop, since_read = asyncio.get_running_loop(), 0.0
        while not self._stopping:
            await asyncio.sleep(SWEEP_S)
            since_read += SWEEP_S
            try:
                if since_read >= FALLBACK_S:
                    since_read = 0.0
                    await self._read_directly()
                now = loop.time()
                for wait in list(self._waits.values()):
                    if not wait.future.done() and (
                        now >= wait.deadline or await wait.client.is_disconnected()
                    ):
                        wait.future.set_result(None)
            except Exception as e:  # this task must outlive anything (a bad record, Redis)
                log.warning("notify sweep: %s", type(e).__name__)

    async def _read_directly(self) -> None:
        """The records of every request still waiting, in one MGET per 1,000."""
        pending = [j for j, w in self._waits.items() if not w.future.done()]
        for at in range(0, len(pending), POP_MOST):
            part = pending[at : at + POP_MOST]
            for job_id, raw in zip(
                part, await self.conn.mget([keys.result_key(j) for j in part]), strict=True
            ):
                if raw is not None:
                    try:
                        self._resolve(job_id, json.loads(raw))
                    except ValueError:  # not JSON: the wait ends at its deadline
                        log.warning("result of %s is not JSON", job_id)
