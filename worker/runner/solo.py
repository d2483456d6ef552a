"""A solo lane: a job that cannot share a batch, run alone a step at a time beside the lanes.

One sampled choice with a ``seed`` that also speculates (a draft or prompt lookup) draws
what it draws from how many tokens each round proposes, so it cannot share a batch
(``worker.schedule.grouping.batchable``). Taken from a queue ahead of a running batch,
it runs here: the alone path (``worker.runner.alone.alone_steps``: the same engine,
text, record and speculation figures as alone), stepped once per side step in turn with
the side lanes (``worker.runner.beside``; solo lanes first come, first served: taking
turns, each would end later), its KV room counted in the worker's ledger.
Before, it ran to its end between two steps of the batch, which waited.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager

from schemas import ResultRecord
from worker.lifecycle.held import Job
from worker.runner.alone import AfterRecord, alone_steps
from worker.runner.company import PEEK
from worker.runner.lane import Host, Ledger
from worker.schedule.route import Route


class Solo:
    """One job run alone, a step at a time, beside the lanes."""

    def __init__(self, host: Host, ledger: Ledger, job: Job, r: Route) -> None:
        self.host, self.ledger, self.job = host, ledger, job
        self.running = True
        upcoming = functools.partial(host.lifecycle.peek, job.queue, PEEK)
        conn = host.lifecycle.conn
        self._steps = alone_steps(job, r, host.rt, conn, upcoming, reserve=self._reserve)

    def again(self, job: Job) -> bool:
        """True if ``job`` runs here already (taken again: it runs on under the new take)."""
        if not self.running or job.id != self.job.id:
            return False
        self.job = job
        return True

    def step(self) -> None:
        """One step of its engine (the first prepares it); its record once it ends."""
        try:
            with self.host.computing():
                next(self._steps)
            return
        except StopIteration as end:
            record, after = end.value
        except BaseException:
            self.close(requeue=True)
            raise
        self.running = False
        self._end(record, after)

    def _end(self, record: ResultRecord, after: AfterRecord) -> None:
        self.host.finish([(self.job, record)])
        if after is not None:
            after()  # a streamed job's final chunk, once its record can be read

    def close(self, requeue: bool = False) -> None:
        """Stop it where it is (``requeue``: back to its queue, unstarted; a cold shutdown)."""
        if self.running:
            self.running = False
            self._steps.close()  # (its engine closes, its KV room frees)
            if requeue:
                self.host.lifecycle.requeue(self.job)
        self.ledger.drop(self)

    @contextmanager
    def _reserve(self, nbytes: int, what: str) -> Iterator[None]:
        """Its KV room, counted in the ledger beside the lanes' (kept prefixes make way)."""
        self.host.rt.cache.make_kv_room(self.ledger.others(self) + nbytes, what)
        self.ledger.set(self, nbytes)
        try:
            yield
        finally:
            self.ledger.drop(self)
