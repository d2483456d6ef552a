"""How large a continuous batch should grow (``--max-batch auto``): measured speed by size.

Pure Python: the runner feeds it the aggregate decoding speed of batches it ran,
by size; it answers with the largest size those measurements favour, and why.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from worker.schedule.estimators import Running

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
