"""How large a continuous batch should grow (``--max-batch auto``): measured speed by size.

Pure Python: the runner feeds it the aggregate decoding speed of batches it ran,
by size (:class:`BatchMemory`, one :class:`BatchRates` per target and batch kind); it
answers with the largest size those measurements favour, and why. The speculation
policy reads the same memory to choose between a batch and one job at a time.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

from worker.schedule.estimators import Running

T = TypeVar("T")

#: k of a batch without speculation.
PLAIN = 0
#: k of a speculative batch that chooses each round's k itself, in the measurements' keys.
ADAPTIVE = -1

#: The batch size a target starts at before anything is measured (``--max-batch auto``).
START_BATCH = 32
#: A larger batch must measure this much faster (tokens/s) than a smaller one to be used.
GROWTH_MARGIN = 0.10
#: Measurements at or below a limit that speed set, before a larger size is tried again.
REPROBE_EVERY = 40


@dataclass
class BatchRates:
    """A target's measured aggregate decoding speed (tokens/s) by batch size, and the
    batch size those measurements favour (``--max-batch auto``)."""

    by_size: dict[int, Running] = field(default_factory=dict)
    since_probe: int = 0  # measurements since a size above the limit was last measured

    def rate(self, size: int) -> float | None:
        """Speed at the measured size nearest ``size`` (ties: the smaller), or None."""
        if not self.by_size:
            return None
        nearest = min(self.by_size, key=lambda n: (abs(n - size), n))
        return self.by_size[nearest].value

    def smallest_step_s(self, most: int | None = None) -> float | None:
        """Seconds of one step at the smallest size measured (size / its tokens/s): what a
        sequence's token costs at best, as far as measured; None before any, or when that
        size is above ``most``."""
        if not self.by_size or (most is not None and min(self.by_size) > most):
            return None
        n = min(self.by_size)
        rate = self.by_size[n].value
        return n / rate if rate > 0 else None

    def record(self, size: int, tokens_per_s: float) -> None:
        settled = self._settled()
        self.by_size.setdefault(size, Running()).update(tokens_per_s)
        self.since_probe = 0 if settled is None or size > settled else self.since_probe + 1

    def _settled(self) -> int | None:
        """The smallest measured size within :data:`GROWTH_MARGIN` of the fastest, if a
        larger size was measured too (where growing stopped paying), else None."""
        if not self.by_size:
            return None
        rates = {n: a.value for n, a in self.by_size.items()}
        fastest = max(rates.values())
        good = min(n for n, r in rates.items() if r * (1 + GROWTH_MARGIN) >= fastest)
        return good if good < max(rates) else None

    def limit(self) -> tuple[int, str]:
        """The largest batch measurements favour, and why.

        Where a larger batch stops paying (:meth:`_settled`) the batch stays, and
        every :data:`REPROBE_EVERY` measurements the next size up is tried again;
        while the largest size measured is also the fastest, the batch may grow to
        twice it (and is measured there).
        """
        if not self.by_size:
            return START_BATCH, f"speed: starting at {START_BATCH} (nothing measured yet)"
        rates = {n: a.value for n, a in self.by_size.items()}
        good = self._settled()
        if good is None:
            top = max(rates)
            grow = max(2 * top, START_BATCH)
            return grow, f"speed: {top} measured fastest ({rates[top]:.1f} tok/s), up to {grow}"
        if self.since_probe >= REPROBE_EVERY:
            return 2 * good, f"speed: re-measuring above {good}"
        above = min(n for n in rates if n > good)
        return good, (
            f"speed: {good} measured {rates[good]:.1f} tok/s, {above} {rates[above]:.1f} "
            "(a larger batch does not pay)"
        )


def batch_kind(draft: str | None, k: int, adaptive: bool) -> tuple[str | None, int]:
    """A batch's kind in the measurements: (None, PLAIN) without a draft, else (draft, k),
    k being :data:`ADAPTIVE` for a batch that chooses k each round."""
    if draft is None or k == PLAIN:
        return None, PLAIN
    return draft, ADAPTIVE if adaptive else k


class BatchMemory:
    """What a worker's batches measured, per (target, adapter) and kind of batch (plain,
    or speculative at a draft and k): speed by size while decoding (:class:`BatchRates`),
    and whole batches first step to last (joins and the tail included). Thread-safe."""

    def __init__(self) -> None:
        self.plain: dict[tuple[str, str | None], BatchRates] = {}
        # (target, adapter, draft, k) -> a speculative batch's speeds by size
        self.spec: dict[tuple[str, str | None, str, int], BatchRates] = {}
        # (target, adapter, draft or None, k) -> whole batches' tokens/s
        self.whole: dict[tuple[str, str | None, str | None, int], Running] = {}
        self._lock = threading.Lock()

    @property
    def lock(self) -> threading.Lock:
        """Held while the figures change (``worker.schedule.shared`` reads them)."""
        return self._lock

    def _rates(
        self, target: str, adapter: str | None, draft: str | None, k: int, adaptive: bool
    ) -> BatchRates:
        draft, k = batch_kind(draft, k, adaptive)
        if draft is None:
            return self.plain.setdefault((target, adapter), BatchRates())
        return self.spec.setdefault((target, adapter, draft, k), BatchRates())

    def record(
        self,
        target: str,
        adapter: str | None,
        size: int,
        tokens: int,
        seconds: float,
        draft: str | None = None,
        k: int = PLAIN,
        adaptive: bool = False,
    ) -> None:
        """``tokens`` decoded in ``seconds`` by a batch of ``size`` jobs (a speculative one
        when ``draft`` and ``k`` are given)."""
        if size < 1 or tokens < 1 or seconds <= 0:
            return
        with self._lock:
            self._rates(target, adapter, draft, k, adaptive).record(size, tokens / seconds)

    def record_whole(
        self,
        target: str,
        adapter: str | None,
        tokens: int,
        seconds: float,
        draft: str | None = None,
        k: int = PLAIN,
        adaptive: bool = False,
    ) -> None:
        """What a whole batch decoded (every step, prefills included)."""
        if tokens < 1 or seconds <= 0:
            return
        key = (target, adapter, *batch_kind(draft, k, adaptive))
        with self._lock:
            self.whole.setdefault(key, Running()).update(tokens / seconds, 0, weight=0.5)

    def limit(
        self,
        target: str,
        adapter: str | None,
        draft: str | None = None,
        k: int = PLAIN,
        adaptive: bool = False,
    ) -> tuple[int, str]:
        """The batch size measured speed favours for (target, adapter), and why."""
        return self._ask(BatchRates.limit, target, adapter, draft, k, adaptive)

    def smallest_step_s(
        self,
        target: str,
        adapter: str | None,
        draft: str | None = None,
        k: int = PLAIN,
        adaptive: bool = False,
        most: int | None = None,
    ) -> float | None:
        """:meth:`BatchRates.smallest_step_s` of this kind of batch."""
        return self._ask(
            lambda rates: rates.smallest_step_s(most), target, adapter, draft, k, adaptive
        )

    def _ask(
        self,
        question: Callable[[BatchRates], T],
        target: str,
        adapter: str | None,
        draft: str | None,
        k: int,
        adaptive: bool,
    ) -> T:
        with self._lock:
            return question(self._rates(target, adapter, draft, k, adaptive))

    def rate(
        self, target: str, adapter: str | None, size: int, draft: str | None = None
    ) -> float | None:
        """Measured speed near ``size`` of a plain batch, or (``draft``) of an adaptive
        speculative one; None before any."""
        with self._lock:
            if draft is None:
                rates = self.plain.get((target, adapter))
            else:
                rates = self.spec.get((target, adapter, draft, ADAPTIVE))
            return rates.rate(size) if rates else None

    def whole_rate(self, target: str, adapter: str | None, draft: str | None) -> float | None:
        """Whole batches' speed, plain or (``draft``) adaptive speculative; None before any."""
        key = (target, adapter, *batch_kind(draft, ADAPTIVE, adaptive=True))
        with self._lock:
            whole = self.whole.get(key)
            return whole.value if whole is not None else None
