"""The lanes a worker steps, and one turn of its loop (``worker.runner.loop``).

A job whose route (``worker.schedule.route``) names a batch opens the worker's *batch
lane* (``worker.runner.lane``: an engine and its rows) on its queue; jobs of queues
served before it (``mlxq.interactive``) join that lane, run in the *side lane* of their
batch key beside it (``worker.runner.beside``; one that cannot be batched, a solo lane:
``worker.runner.solo``), run alone between two turns, or wait.
Each turn of the worker's loop asks the step rules for a plan
(``worker.schedule.step.plan``: which lane steps, how much prompt it may prefill,
whether to look at the queues ahead), applies it, fills free places from each lane's
queue (its model's jobs first; one of another key whose models are loaded runs in that
key's side lane) and publishes. Memory admits each joiner (the KV bytes a lane can grow
to, one ledger for all), ``--max-batch auto`` grows a lane while a larger one measures
faster. A job that cannot be placed goes back to the front of its queue, first in first
out, and is taken again when the lanes change (a job joins or leaves one: no timer).
The rules are ``worker.schedule.step``'s, pure, with their constants in
``WorkerRuntime.step``; docs/scheduling.md tells them with their reasons.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager

from redis.exceptions import RedisError

from schemas import ChatRequest
from schemas.fleet import BatchInfo
from worker.lifecycle.held import Job
from worker.runner.alone import kv_need
from worker.runner.beside import Beside
from worker.runner.embedjobs import is_embedding
from worker.runner.lane import (
    QUEUE_EMPTY,
    Host,
    Lane,
    Ledger,
    evictable,
    mine,
    same_kind,
)
from worker.schedule.grouping import BatchKey
from worker.schedule.route import Route, route
from worker.schedule.step import (
    BatchView,
    Waiting,
    kept_rows,
    owed_after_beside,
    owed_after_step,
    plan,
    preempt_for_room,
    preempted,
    where,
)

log = logging.getLogger(__name__)

#: Seconds between two updates of the batch state the worker publishes.
PUBLISH_EVERY_S = 0.5
#: The most sequences one lane holds under ``--max-batch auto``.
AUTO_CAP = 256
#: Seconds between two looks at the queues served before the batch's.
LOOK_EVERY_S = 0.1
#: Seconds before the queues ahead are looked at again after Redis did not answer.
REDIS_RETRY_S = 1.0


class Lanes:
    """A worker's batch lane and side lanes, and one turn of its loop over them."""

    def __init__(self, host: Host) -> None:
        self.host, self.rt = host, host.rt
        self.cfg = self.rt.step  # the step rules' constants
        self.cap = host.max_batch or AUTO_CAP
        self.ledger = Ledger(self.rt.cache)
        #: The batch's lane (None: no batch runs), and the side lanes beside it.
        self.lane: Lane | None = None
        self.beside = Beside(host, self.ledger, self.cap)
        self.queue, self.depth = "", 1  # the batch's queue; how many waited when it began
        self.ahead: list[str] = []  # the queues served before the batch's
        self._look_at = 0.0
        self._waits: int | None = None  # the ledger's version when a job ahead went back
        self._owed = 0.0  # step seconds the batch is owed by work beside it (< 0: ahead)
        self._seen_ahead = -float("inf")  # when a job was last seen waiting ahead
        self._joining = False  # inside a join (a kept prefix prefilling): none may join now
        self._chunk_at = 0.0  # when the last chunk of such a prefill ended
        self._published_at = -PUBLISH_EVERY_S

    @property
    def live(self) -> bool:
        """Whether a batch runs (its lanes hold jobs, or may take more)."""
        return self.lane is not None

    def open(self, queue: str, key: BatchKey, depth: int, first: Job, first_route: Route) -> None:
        """Open the batch's lane on ``queue`` with ``first`` (routed to ``key``) and the
        queued jobs that join it before its first step."""
        host = self.host
        self.cfg, self.queue, self.depth = self.rt.step, queue, depth
        before = host.queues.index(queue) if queue in host.queues else 0
        self.ahead = host.queues[:before]
        self._owed, self._seen_ahead, self._look_at, self._waits = 0.0, -float("inf"), 0.0, None
        # someone may wait for the next step: prefill is cut to fit (not in a group)
        budgeted = bool(self.ahead) and self.rt.cache.group is None
        self.lane = lane = Lane(host, queue, key, self.ledger, self.cap, budgeted)
        lane.start(first_route)
        with self._guard():
            self._add(lane, first, first_route)
            self._fill(lane)

    def turn(self) -> None:
        """One turn of the worker's loop while a batch runs: the plan's lane steps, jobs
        waiting ahead go where the rules say, free places fill. The batch ends when every
        lane is empty. A BaseException (a cold shutdown) gives every job still in a
        lane back to its queue; an unexpected error fails the batch's lane's jobs."""
        lane = self.lane
        assert lane is not None
        with self._guard():
            p = plan(self._view(), self.cfg)
            if p.step == "batch":
                seconds = lane.step(p.budget)
                self._owed = owed_after_step(self._owed, seconds, self.cfg)
            elif p.step == "side":
                self._step_side()
            if p.look:
                self._look_ahead()
            self._fill(lane)
            self.beside.close_if_empty()
            self._publish()
            if not lane.rows and not self.beside.live:
                lane.meter.close()
                self._end()

    @contextmanager
    def _guard(self) -> Iterator[None]:
        """What a failure does to the lanes (see :meth:`turn`)."""
        lane = self.lane
        assert lane is not None
        try:
            yield
        except Exception as e:
            log.exception("batch on %s failed; failing its %d job(s)", lane.key[0], len(lane.rows))
            lane.fail_all(e)
            self._end()  # (the side lanes' jobs run later)
        except BaseException:
            self._end(requeue=True)
            raise

    def _end(self, requeue: bool = False) -> None:
        """The batch has ended: its lanes close (side lanes' jobs go back; ``requeue``: all)."""
        self.beside.close(requeue=True)
        self.host.batch = None
        if self.lane is not None:
            self.lane.close(requeue)
            self.lane = None

    def _add(self, lane: Lane, job: Job, r: Route, keep: int | None = None) -> bool:
        """Put ``job`` into ``lane``; while a shared prefix prefills to keep as a job of
        the batch's own joins, jobs waiting ahead may run between its chunks. ``keep``
        (a job from a queue ahead, first to prefill): own rows that stay when others make
        memory for it."""
        first = keep is not None
        chunked = lane is self.lane and lane.budgeted and not first
        between = self._between_chunks if chunked else None
        self._chunk_at = time.perf_counter()
        return lane.add(job, r, first=first, between=between, keep=keep)

    # -- taking jobs ------------------------------------------------------
    def _fill(self, lane: Lane) -> None:
        """Free places of ``lane`` filled from its queue, its model's jobs first (one of
        another key: its side lane when ``Beside.adopts`` it)."""
        assert self.lane is not None
        while lane.may_take():
            limit, reason = lane.limit()
            if lane.size() >= limit:
                lane.reason = reason
                return
            if lane.held is not None:
                if not lane.admission(*lane.held).join:
                    return  # the job at the head waits for room; nothing overtakes it
                lane.held = None
            job = self.host.take_from(lane.queue, lane.key.model)  # its model's first
            if job is None:
                lane.reason = QUEUE_EMPTY
                return
            if lane.again(job):
                continue
            r = None if is_embedding(job) else self._route(lane, job)  # (embedded after)
            if r is None or (r.batch != lane.key and not self.beside.adopts(r, self.lane.key)):
                self._hand_back(lane, job)
                return
            if r.batch == lane.key:
                if not self._add(lane, job, r):
                    return
            elif not self.beside.put(job, r):
                lane.block()  # it went back to the front: it goes first
                return

    def _route(self, lane: Lane, job: Job) -> Route:
        """How ``job`` would run beside ``lane``'s rows (on the lane's terms when it is of
        the kind the lane was started for)."""
        depth = max(self.depth, lane.size() + 1)
        r = route(job.envelope.request, self.rt.policy, depth, decide_alone=False)
        if r.batch != lane.key and same_kind(lane, job, r):
            # the policy's new mind is for the next batch
            r = dataclasses.replace(r, batch=lane.key, decision=lane.decision)
        return r

    def _hand_back(self, lane: Lane, job: Job) -> None:
        """``job`` cannot run in the lanes now: back to the front of its queue, first in
        first out; ``lane`` takes again when the lanes change (a job joins or leaves)."""
        self.host.lifecycle.requeue(job)
        lane.block()

    # -- interactive jobs -------------------------------------------------
    def _between_chunks(self) -> None:
        """Between two chunks of a shared prefix prefilled as a job joins: that prefill is
        the batch's work, paid to its floor as a step's; jobs waiting ahead may be taken
        (none joins now) and side lanes step while the batch is owed nothing."""
        now = time.perf_counter()
        self._owed = owed_after_step(self._owed, now - self._chunk_at, self.cfg)
        self._joining = True
        try:
            if plan(self._view(), self.cfg).look:
                self._look_ahead()
            while self.beside.rows() and self._owed <= 0:
                self._step_side()
        finally:
            self._joining = False
            self._chunk_at = time.perf_counter()

    def _look_ahead(self) -> None:
        """Jobs waiting in the queues served before the batch's: they join it, or run in
        their side lane or alone between two steps, or (none possible) wait for the batch."""
        self._look_at = time.monotonic() + LOOK_EVERY_S
        while (queue := self._first_waiting()) is not None:
            self._seen_ahead = time.monotonic()
            job = self.host.take_from(queue)
            if job is None or not self._place_ahead(job):
                return

    def _view(self) -> BatchView:
        """What the step rules (``worker.schedule.step``) read of the batch now."""
        lane = self.lane
        assert lane is not None
        own = sum(mine(r, self.queue) for r in lane.rows.values())  # (streams are nobody's)
        smallest = self.rt.policy.sizes.smallest_step_s(*lane.key, most=self.cfg.small_size)
        now = time.monotonic()
        return BatchView(
            size=lane.size(),
            cap=self.cap,
            limit=lane.limit()[0],
            own=own,
            step_s=lane.step_s,
            decode_s=lane.decode_s,
            smallest_step_s=smallest,
            prefill_steps=lane.engine.prefill_steps if lane.engine is not None else 0,
            in_group=self.rt.cache.group is not None,
            beside=self.beside.rows(),
            since_ahead_s=now - self._seen_ahead,
            owed=self._owed,
            ahead=bool(self.ahead) and self.host.may_take(),  # a stopping worker takes none
            look_due=now >= self._look_at and self._waits != self.ledger.version,
            budgeted=lane.budgeted,
            prefill_rate=getattr(lane.engine, "prefill_rate", None),
        )

    def _first_waiting(self) -> str | None:
        """The first queue ahead that holds a job; None too when Redis does not answer (the
        batch's own jobs need Redis only at their end, and are not failed by a look)."""
        try:
            return self.host.lifecycle.first_waiting(self.ahead)
        except RedisError as e:
            log.warning("could not look at %s (%s); looking again later", self.ahead, e)
            self._look_at = time.monotonic() + REDIS_RETRY_S
            return None

    def _place_ahead(self, job: Job) -> bool:
        """Run ``job`` from a queue ahead of the batch's where the step rules say
        (``worker.schedule.step.where``): True when the next may come now (it joined,
        ended at once, or ran beside with the batch owed nothing), False when the batch
        steps first (it went back to wait, or the batch is owed its share)."""
        lane = self.lane
        assert lane is not None
        if lane.again(job) or self.beside.again(job):
            return True
        if is_embedding(job):
            return self._embed_ahead(job)
        req = job.envelope.request
        assert isinstance(req, ChatRequest)
        r = self._route(lane, job)
        alone = route(req, self.rt.policy, batching=False)
        side = r if r.batch is not None else alone  # (one that cannot be batched: solo)
        view = self._view()
        joinable = r.batch == lane.key and not self._joining
        waiting = Waiting(joinable, True, self.beside.takes(side), req.n)
        to = where(view, waiting, self.cfg)  # a join pays whatever room there is beside
        if to not in ("join", "preempt"):  # (so the job is prepared for its need only now)
            need = kv_need(job, alone, self.rt, self.host.lifecycle.conn)
            fits = need is not None and self.rt.cache.fits_beside(need)
            to = where(view, dataclasses.replace(waiting, fits_beside=fits), self.cfg)
            if to == "wait" and need is not None and self._room_beside(view, need):
                to = where(view, dataclasses.replace(waiting, fits_beside=True), self.cfg)
        if to in ("join", "preempt"):
            if to == "preempt":
                rows = list(lane.rows.values())
                lane.remove(rows[preempted([mine(w, self.queue) for w in rows])])
            self._add(lane, job, r, keep=kept_rows(view, self.cfg))
            return True
        if to == "side" and self.beside.put(job, side):
            return True
        if to == "wait":
            self.host.lifecycle.requeue(job)  # first in its queue still
        if to in ("side", "wait"):  # (it went back: looked at again when lanes change)
            self._waits = self.ledger.version
            return False
        t = time.monotonic()
        self.host.run_alone(job, alone)
        return self._ran_beside(time.monotonic() - t)

    def _room_beside(self, view: BatchView, need: int) -> bool:
        """Own rows of the batch give their places up so that ``need`` more KV bytes fit
        beside it (``step.preempt_for_room``; not while a kept prefix prefills as a job
        joins). Whether they did."""
        lane = self.lane
        assert lane is not None
        if self._joining:
            return False
        rows, freed = evictable(lane, kept_rows(view, self.cfg))
        k = preempt_for_room(self.rt.cache.short_beside(need), freed)
        for row in rows[: k or 0]:
            lane.remove(row)
        return bool(k)

    def _embed_ahead(self, job: Job) -> bool:
        """An embedding job from a queue ahead: embedded between two steps when its model
        is loaded (loading one could evict the batch's), else after the batch."""
        if (job.envelope.request.model, None) not in self.rt.cache:
            self.host.lifecycle.requeue(job)
            self._waits = self.ledger.version
            return False
        t = time.monotonic()
        self.host.run_embeddings(job)
        return self._ran_beside(time.monotonic() - t)

    def _ran_beside(self, took: float) -> bool:
        """Work ran beside the batch for ``took`` seconds: the batch is owed its floor's
        share of that. Whether the next may run at once (nothing owed)."""
        self._owed = owed_after_beside(self._owed, took, self.cfg)
        return self._owed <= 0

    def _step_side(self) -> None:
        """One step of a side lane (each in turn), then its free places filled; paid to
        the batch's floor while its lane holds jobs (or is prefilling a kept prefix)."""
        assert self.lane is not None
        bound = bool(self.lane.rows) or self._joining
        t = time.perf_counter()
        if self.beside.step(self._fill) and bound:
            self._ran_beside(time.perf_counter() - t)

    def _publish(self) -> None:
        """Show the batch's state to the worker's registry entry (at most every
        :data:`PUBLISH_EVERY_S`; the heartbeat publishes it every 2 s)."""
        now = time.monotonic()
        if now >= self._published_at + PUBLISH_EVERY_S:
            self._published_at = now
            self.host.batch = published(self.lane) if self.lane is not None else None


def published(lane: Lane) -> BatchInfo:
    """What the worker publishes of its batch's lane (``producer fleet``)."""
    return BatchInfo(
        model=lane.key[0],
        size=lane.size(),
        limit=lane.limit()[0],
        reason=lane.reason,
        kv_mb=round(lane.kv_bytes / 1e6, 1),
        kv_projected_mb=round(lane.projected / 1e6, 1),
        kv_room_mb=round(lane.room() / 1e6, 1),
    )
