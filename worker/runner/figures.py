"""The fleet's shared figures in Redis: read at a pair's first use, written as they grow.

A worker that shares figures (the default; ``--no-share-figures`` keeps them to
itself) reads a scope's entries the first time it decides for a (target,
adapter, proposer) in this process, merges them (``schemas.figures.merge``) and
lets its policy adopt them (``worker.schedule.shared.adopt``): a restarted or new
worker of a kind the fleet has measured starts from the fleet's decision. It
writes what it measured itself on each heartbeat that has something new, and at
exit, under a field of its own process (``<worker>#<random>``), so a restart
never overwrites what the process before it measured.

Nothing here fails a job: an unreadable model, an unreachable Redis or a hostile
entry is logged and the worker measures for itself, as without sharing.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
from redis import Redis

from schemas.figures import (
    INDEX,
    MAX_AGE_S,
    MAX_WORKERS,
    ScopeLabel,
    TargetFigures,
    merge,
    read_entries,
    scope_key,
    scope_of,
)
from worker.engine.identity import machine_kind, weights_identity
from worker.schedule.policy import LOOKUP, SpeculationPolicy
from worker.schedule.shared import adopt, export

log = logging.getLogger(__name__)


class SharedFigures:
    """One worker process's side of the fleet's figures."""

    def __init__(
        self,
        conn: Redis,
        policy: SpeculationPolicy,
        find: Callable[[str], Path | None],
        worker: str,
        kind: str | None = None,
    ) -> None:
        self.conn, self.policy, self.find, self.worker = conn, policy, find, worker
        self.kind = kind or machine_kind()
        self.mlx = mx.__version__
        self.field = f"{worker}#{secrets.token_hex(4)}"  # this process's entries
        self.adopted = 0  # measurements taken from the fleet
        self._ids: dict[str, str | None] = {}
        self._written: dict[str, str] = {}  # target id -> the last entry written (no time)
        self._lock = threading.Lock()  # one publish at a time (heartbeat, exit)
        policy.on_first_use = self.use

    # -- identities -------------------------------------------------------
    def identify(self, name: str) -> str | None:
        """``name``'s weights identity (computed once per process), or None: unreadable,
        or not on this machine yet (a hub model before its first load: asked again)."""
        if name in self._ids:
            return self._ids[name]
        try:
            path = self.find(name)
            if path is None:
                return None  # not fetched yet: known after the job that loads it
            self._ids[name] = weights_identity(path)
        except Exception as e:  # any failure: this name's figures are not shared
            log.info("figures: %s not shared (%s)", name, e)
            self._ids[name] = None
        return self._ids[name]

    def _known(self, name: str) -> str | None:
        """An identity already computed (the heartbeat thread never reads weights)."""
        return self._ids.get(name)

    def scope(self, target_id: str) -> str:
        return scope_of(self.kind, self.mlx, target_id)

    # -- reading ----------------------------------------------------------
    def fleet(self, target: str) -> TargetFigures | None:
        """What the fleet believes of ``target`` on this kind of machine, or None."""
        target_id = self.identify(target)
        if target_id is None:
            return None
        raw = self.conn.hgetall(scope_key(self.scope(target_id)))
        entries, skipped = read_entries(raw, target_id, self.kind, self.mlx)
        for why in skipped:
            log.warning("figures of %s: entry %s ignored", target, why)
        return merge(entries)

    def use(self, target: str, adapter: str | None, proposer: str | None) -> bool:
        """The policy's first decision for these: adopt the fleet's figures, if any.
        False when a model is not on this machine yet (asked again at the next job)."""
        try:
            names = [n for n in (target, adapter, proposer) if n is not None and n != LOOKUP]
            if any(self.identify(n) is None and n not in self._ids for n in names):
                return False
            figures = self.fleet(target)
            if figures is None:
                return True
            taken = adopt(self.policy, target, adapter, proposer, figures, self.identify)
        except Exception as e:  # Redis down, anything: measure here instead
            log.warning("figures of %s not read (%s): measuring here", target, e)
            return True
        if taken:
            self.adopted += taken
            log.info(
                "figures: %s%s: %d measurement(s) from the fleet (%s)",
                target,
                f" + {proposer}" if proposer else "",
                taken,
                self.kind,
            )
        return True

    # -- writing ----------------------------------------------------------
    def publish(self) -> int:
        """Write what this worker measured that changed since the last write (every
        target with a known identity). Returns the entries written."""
        if not self._lock.acquire(blocking=False):
            return 0
        try:
            return self._publish()
        except Exception as e:
            log.warning("figures not written (%s)", e)
            return 0
        finally:
            self._lock.release()

    def _publish(self) -> int:
        with self.policy.lock:
            targets = {t for t, _ in self.policy.pairs}
        with self.policy.sizes.lock:
            targets |= {t for t, _ in self.policy.sizes.plain}
            targets |= {key[0] for key in self.policy.sizes.spec}
        now, written = time.time(), 0
        for target in sorted(targets):
            entry = export(
                self.policy,
                target,
                self._known,
                worker=self.worker,
                kind=self.kind,
                mlx=self.mlx,
                now=now,
            )
            if entry is None:
                continue
            same = entry.model_dump_json(exclude={"at"})
            if self._written.get(entry.target) == same:
                continue
            scope = self.scope(entry.target)
            label = ScopeLabel(
                target=target, target_id=entry.target, kind=self.kind, mlx=self.mlx, at=now
            )
            pipe = self.conn.pipeline(transaction=False)
            pipe.hset(scope_key(scope), self.field, entry.model_dump_json())
            pipe.expire(scope_key(scope), MAX_AGE_S)
            pipe.hset(INDEX, scope, label.model_dump_json())
            pipe.hlen(scope_key(scope))
            *_, held = pipe.execute()
            if held > MAX_WORKERS:
                self._prune(scope, now)
            self._written[entry.target] = same
            written += 1
        return written

    def _prune(self, scope: str, now: float) -> None:
        """Keep a scope's :data:`MAX_WORKERS` newest usable entries."""
        raw = self.conn.hgetall(scope_key(scope))
        dated: list[tuple[float, bytes]] = []
        for field, value in raw.items():
            try:
                at = TargetFigures.model_validate_json(value).at
            except ValueError:
                at = 0.0  # unusable: first to go
            dated.append((at if now - at <= MAX_AGE_S else 0.0, field))
        dated.sort(reverse=True)
        drop = [f for _, f in dated[MAX_WORKERS:]]
        if drop:
            self.conn.hdel(scope_key(scope), *drop)
