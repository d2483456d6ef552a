"""The side lanes: jobs from queues ahead of the batch's, batched beside its lane.

A job taken ahead (``mlxq.interactive``) that does not join the batch's lane but can be
batched, or a job a lane took for another key whose models are loaded, runs in the side
lane of its batch key, opened for it when none is open: at most
``StepConfig.side_lanes`` keys at a time (several loaded models, or one model's plain and
speculative jobs), each an engine with its own KV caches, counted in the worker's one
ledger. A job from a queue ahead that cannot share a batch runs in a solo lane of its
own (``worker.runner.solo``), counted as one of them. Each side step steps one of them,
in turn. Not in a worker group, whose ranks mirror one engine.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from schemas import keys
from worker.lifecycle.held import Job
from worker.runner.lane import Host, Lane, Ledger
from worker.runner.solo import Solo
from worker.schedule.grouping import BatchKey
from worker.schedule.policy import LOOKUP
from worker.schedule.route import Route
from worker.schedule.step import side_lane_free, side_turn

log = logging.getLogger(__name__)


class Beside:
    """The side lanes beside a batch's lane, one per batch key, stepped in turn."""

    def __init__(self, host: Host, ledger: Ledger, cap: int) -> None:
        self.host, self.ledger, self.cap = host, ledger, cap
        self.lanes: dict[BatchKey, Lane] = {}
        self.solos: list[Solo] = []  # jobs that cannot share a batch, one lane each
        self._turn = 0  # which lane steps next (in the order they opened)

    @property
    def live(self) -> bool:
        return bool(self.lanes or self.solos)

    def rows(self) -> int:
        """The sequences all side lanes hold (a solo lane's one too)."""
        return sum(lane.size() for lane in self.lanes.values()) + len(self.solos)

    def again(self, job: Job) -> bool:
        return any(x.again(job) for x in [*self.lanes.values(), *self.solos])

    def takes(self, r: Route) -> bool:
        """Whether a job routed ``r`` (it could not join the batch) runs here: in its key's
        lane (open, or another may open), or in a solo lane (it cannot be batched: a
        route alone, with its decision) where another may open."""
        if self.host.rt.cache.group is not None or (r.batch is None and r.decision is None):
            return False
        return side_lane_free([*self.lanes, *self.solos], r.batch, self.host.rt.step)

    def adopts(self, r: Route, batch: BatchKey) -> bool:
        """Whether a job a lane took for another key (routed ``r``) runs here: not the
        ``batch``'s key (its lane takes it), its models loaded (loading one could evict
        a lane's), a side lane free for it."""
        if r.batch is None or r.batch == batch or not self.takes(r):
            return False
        model, adapter, draft = r.batch.model, r.batch.adapter, r.batch.draft
        cache = self.host.rt.cache
        warm = (model, adapter) in cache
        return warm and (draft in (None, LOOKUP) or (draft, None) in cache)

    def put(self, job: Job, r: Route) -> bool:
        """Put ``job`` in its key's lane (opened for it if none is): False when it went
        back to wait for a place or room (or ended at once, failing). A job routed alone
        opens a solo lane."""
        if r.batch is None:
            solo = Solo(self.host, self.ledger, job, r)
            solo.step()  # prepared, its KV room held now (before any lane takes it)
            if solo.running:
                self.solos.append(solo)
            return True
        lane = self.lanes.get(r.batch)
        if lane is None:
            queue = keys.base_queue(job.queue)
            lane = Lane(self.host, queue, r.batch, self.ledger, self.cap, budgeted=False)
            lane.start(r)
            self.lanes[r.batch] = lane
        limit, _ = lane.limit()
        if lane.size() < limit and lane.add(job, r, first=True):
            return True
        if lane.size() >= limit:
            self.host.lifecycle.requeue(job)  # its lane takes it when a place frees
        if not lane.rows:
            self._close(lane)
        return False

    def step(self, fill: Callable[[Lane], None]) -> bool:
        """One step of the next side lane in turn, then ``fill`` its free places: False
        when it failed (its own jobs fail, not the batch's or the other lanes', and it
        closes)."""
        order: list[Lane | Solo] = [*self.lanes.values(), *self.solos]
        lane = order[side_turn(self._turn, len(self.lanes), len(self.solos))]
        self._turn += 1
        if isinstance(lane, Solo):  # (what fails it is its record: alone_steps)
            lane.step()
            if not lane.running:
                self.solos.remove(lane)
            return True
        try:
            lane.step()
            fill(lane)
        except Exception as e:
            log.exception("side lane on %s failed; failing its job(s)", lane.key[0])
            lane.fail_all(e)
            self._close(lane)
            return False
        except BaseException:
            self.close(requeue=True)
            raise
        return True

    def close_if_empty(self) -> None:
        """Side lanes left without jobs close."""
        for lane in [x for x in self.lanes.values() if not x.rows]:
            lane.meter.close()
            self._close(lane)

    def close(self, requeue: bool = False) -> None:
        """Every side lane closes (``requeue``: their jobs go back to their queues)."""
        for lane in list(self.lanes.values()):
            self._close(lane, requeue)
        for solo in self.solos:
            solo.close(requeue)
        self.solos = []

    def _close(self, lane: Lane, requeue: bool = False) -> None:
        self.lanes.pop(lane.key, None)
        lane.close(requeue)
