"""The worker's heartbeat thread: its lease, its public state, and recovery passes.

One thread per worker process, whatever the main thread is doing (loading or
downloading a model for minutes, prefilling a long prompt, decoding a batch):
it renews the process's lease, which covers every job the process holds,
every third of the lease; runs a recovery pass every half lease (and hands back
any job Redis lists as held here that this process is not running); and
publishes the worker's state for ``producer fleet`` every couple of seconds.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from worker.lifecycle.held import Lifecycle

log = logging.getLogger(__name__)

#: Seconds between publishes of the worker's state (``mlxq:worker:<name>``).
PUBLISH_EVERY_S = 2.0


class Heartbeat(threading.Thread):
    """Renews the lease, recovers dead workers' jobs and publishes state, in the background."""

    def __init__(self, lifecycle: Lifecycle, publish: Callable[[], None]) -> None:
        super().__init__(name=f"mlxq-heartbeat-{lifecycle.name}", daemon=True)
        self.lifecycle, self.publish = lifecycle, publish
        lease_s = lifecycle.lease_ms / 1000
        self.renew_every, self.recover_every = lease_s / 3, lease_s / 2
        self._closed = threading.Event()
        now = time.monotonic()
        self._renewed = self._recovered = now
        self._published = 0.0

    def close(self, timeout: float = 5.0) -> None:
        """Stop beating; wait up to ``timeout`` for a beat under way (a stopping worker waits
        little: a beat stuck on an unreachable Redis must not hold its exit)."""
        self._closed.set()
        if self.is_alive():
            self.join(timeout=timeout)

    def run(self) -> None:
        tick = min(self.renew_every, PUBLISH_EVERY_S, 1.0)
        while not self._closed.wait(tick):
            self.beat()

    def beat(self) -> None:
        """Do whatever is due (each part on its own: one failing does not stop the others)."""
        now = time.monotonic()
        if now - self._renewed >= self.renew_every:
            self._renewed = now
            self._guard("renewing the lease", self._renew)
        if now - self._recovered >= self.recover_every:
            self._recovered = now
            self._guard("recovery", self.lifecycle.recover)
            self._guard("reconciling held jobs", self.lifecycle.reconcile)
            self._guard("registry pruning", self.lifecycle.prune)
        if now - self._published >= PUBLISH_EVERY_S:
            self._published = now
            self._guard("publishing state", self.publish)

    def _renew(self) -> None:
        if not self.lifecycle.renew():
            log.error(
                "worker %s: its lease had ended (stalled longer than the lease?): recovery has "
                "given its jobs to other workers; going on under a fresh lease",
                self.lifecycle.name,
            )

    @staticmethod
    def _guard(what: str, action: Callable[[], object]) -> None:
        try:
            action()
        except Exception as e:  # Redis may be away for a while; the lease has slack
            log.warning("heartbeat: %s failed: %s", what, e)
