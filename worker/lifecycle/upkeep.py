"""Fleet upkeep: a worker process's lease and the passes that keep the fleet's jobs moving.

Redis only, no MLX. Mixed into :class:`worker.lifecycle.held.Lifecycle`, beside a job's
own transitions (take, refuse, end, requeue): the lease every job of a process rides on
(register, renew, unregister), recovery of dead processes' jobs (requeue, or fail as
poison after ``--max-crashes``), the hand-back of jobs Redis lists as held here that
nothing runs (reconcile), and pruning of RQ's registries. The heartbeat thread
(:mod:`worker.lifecycle.heartbeat`) runs them; each is a script of
:mod:`worker.lifecycle.scripts`.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from redis import Redis

from schemas import JobRefused, MlxqError, PoisonJobError, keys, read_job_hash
from schemas.keys import rq_time
from worker.lifecycle import scripts

log = logging.getLogger(__name__)

#: How long a job's crash counter is kept.
CRASH_MEMORY_S = 7 * 24 * 3600
#: Expired registry entries one prune call removes per registry (about 2 ms of Redis).
PRUNE_STEP = 2000


@dataclass(frozen=True)
class Recovered:
    """One job a recovery pass acted on (``kind`` as returned by ``scripts.RECOVER``)."""

    kind: str
    job_id: str
    queue: str
    crashes: int


def crash_note(r: Recovered, max_crashes: int) -> str:
    """What a requeue after a crash says: the count against ``--max-crashes``."""
    return (
        f"lost its worker: crash {r.crashes} of {max_crashes} (--max-crashes; "
        f"crash {max_crashes} fails it as poison); requeued"
    )


class Upkeep:
    """A worker process's lease and its share of the fleet's upkeep (see the module)."""

    conn: Redis
    name: str
    host: str
    pid: int
    token: str
    inbox: str
    worker_key: str
    holder: str
    queues: list[str]
    lease_ms: int
    max_crashes: int
    holding: set[str]
    _holding_lock: threading.Lock
    _suspects: set[str]

    @property
    def worker_ttl(self) -> int:
        """Seconds RQ's worker record (``registry``) outlives the last heartbeat."""
        return max(60, 3 * self.lease_ms // 1000)

    # a job's transitions (``held.Lifecycle``), which upkeep uses
    _requeue: Callable[[str, str], bool]
    _fail_unrun: Callable[[str, str, dict[str, Any] | None, MlxqError], bool]

    def register(self) -> None:
        """Start this process's lease, end those of dead earlier processes of the same name on
        this host (a restart after a crash), and give back the jobs of every dead holder now
        rather than a lease from now."""
        for token, raw in self.conn.hgetall(keys.HOLDERS).items():
            try:
                info = json.loads(raw)
                ours = info["name"] == self.name and info["host"] == self.host
                dead = ours and info["pid"] != self.pid and not alive(int(info["pid"]))
            except (ValueError, KeyError, TypeError):
                continue
            if dead:
                self.conn.zadd(keys.LEASES, {token: 0}, xx=True)
                log.warning(
                    "worker %s: previous process (pid %s) died; name reclaimed",
                    self.name,
                    info["pid"],
                )
        self.renew()
        self.recover()

    def unregister(self) -> list[str]:
        """End the lease; whatever is still held or in the inbox goes back to its queue."""
        ids = self.conn.eval(
            scripts.UNREGISTER,
            4,
            *(keys.RUNNING, keys.LEASES, keys.HOLDERS, self.inbox),
            *(self.token, keys.rq_job_key(""), keys.rq_started_key(""), keys.rq_queue_key("")),
            self.queues[0],
        )
        handed = [i.decode() for i in ids]
        if handed:
            log.warning("worker %s: jobs %s handed back at exit", self.name, ", ".join(handed))
        return handed

    def renew(self) -> bool:
        """Extend this process's lease (every job it holds). False if it had ended."""
        return bool(
            self.conn.eval(
                scripts.RENEW,
                3,
                *(keys.LEASES, keys.HOLDERS, self.worker_key),
                *(self.token, self.lease_ms, self.holder, rq_time(), self.worker_ttl),
            )
        )

    def recover(self) -> list[Recovered]:
        """Give back the jobs of processes whose lease ended; fail poison jobs (taken here)."""
        reply = self.conn.eval(
            scripts.RECOVER,
            3,
            *(keys.RUNNING, keys.LEASES, keys.HOLDERS),
            *(self.token, self.max_crashes, CRASH_MEMORY_S),
            *(keys.rq_job_key(""), keys.result_key(""), keys.rq_started_key("")),
            *(keys.rq_queue_key(""), keys.crashes_key(""), keys.inbox_key("")),
        )
        done = [Recovered(k.decode(), i.decode(), q.decode(), int(n)) for k, i, q, n in reply]
        for r in done:
            if r.kind == "poison":
                self._poison(r)
            elif r.kind == "requeued":
                log.warning("%s: job %s %s", self.name, r.job_id, crash_note(r, self.max_crashes))
            else:
                log.info("%s: recovery: job %s %s", self.name, r.job_id, r.kind)
        return done

    def reconcile(self) -> list[str]:
        """Hand back jobs Redis lists as held by this process that it is not running.

        A step whose reply was lost (a failover, a timeout) and was sent again can
        leave one: a take applied twice holds a second job nobody runs, and a record
        acknowledged by a primary that then died is gone while the job still reads
        as held here. Such a job would never be recovered (this process's lease is
        alive), so it goes back to its queue, after two passes in a row find it (a
        take in flight is in ``holding`` by the next pass). Returns the ids handed
        back."""
        mine = {}
        for job_id, value in self.conn.hgetall(keys.RUNNING).items():
            token, _, queue = value.decode().partition(" ")
            if token == self.token:
                mine[job_id.decode()] = queue
        with self._holding_lock:
            orphans = set(mine) - self.holding
        confirmed, self._suspects = orphans & self._suspects, orphans - self._suspects
        back = [j for j in sorted(confirmed) if self._requeue(j, mine[j])]
        for job_id in back:
            log.warning(
                "%s: job %s was held here in Redis but not running (a reply lost in a "
                "failover?); handed back to its queue",
                self.name,
                job_id,
            )
        return back

    def prune(self, step: int = PRUNE_STEP, most: int = 10) -> int:
        """Drop expired entries of RQ's finished / failed registries of this worker's queues,
        ``step`` per registry per script call, at most ``most`` calls; how many went."""
        tenants = [  # the lists of tenants on this worker's queues have registries too
            name
            for k in self.conn.smembers(keys.RQ_QUEUES)
            if "@" in (name := k.decode().removeprefix(keys.rq_queue_key("")))
            and keys.base_queue(name) in self.queues
        ]
        registries = [
            f(q)
            for q in [*self.queues, *tenants]
            for f in (keys.rq_finished_key, keys.rq_failed_key)
        ]
        removed = 0
        for _ in range(most):
            n = int(self.conn.eval(scripts.PRUNE, len(registries), *registries, step))
            removed += n
            if n < step:
                break
        return removed

    def _poison(self, r: Recovered) -> None:
        error = PoisonJobError(
            f"the worker running this job died {r.crashes} times (its lease ended each time); "
            "not retried again"
        )
        fields = self.conn.hgetall(keys.rq_job_key(r.job_id))
        try:
            payload: dict[str, Any] | None = read_job_hash(r.job_id, fields).envelope.model_dump()
        except JobRefused as e:
            payload = e.payload
        self._fail_unrun(r.job_id, r.queue, payload, error)
        log.warning("%s: job %s failed: %s", self.name, r.job_id, error)


def alive(pid: int) -> bool:
    """Whether process ``pid`` exists on this host."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
