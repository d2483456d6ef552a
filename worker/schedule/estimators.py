"""The estimators scheduling decisions rest on, written once.

- :func:`ewma`, :class:`Running`: a running average that follows drift;
- :class:`AffineCost`: seconds as a line in a size (tokens a pass processes, draft
  tokens per round), fitted to a running average at each size measured;
- :class:`Acceptance`: a draft's per-token acceptance p under the geometric model
  (accepted draft tokens over accepted plus rejections), old evidence fading;
- :func:`expected_tokens`: what a round drafting k emits at acceptance p.

Pure Python: the speculation policy (one job at a time, whole batches) and the
goodput model (each round of a speculative batch) both use them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

#: Weight of a new measurement in a running average.
EWMA = 0.3
#: Per update, the share of past acceptance evidence that is kept.
FADE = 0.9


def ewma(old: float | None, new: float, weight: float = EWMA) -> float:
    """``new`` folded into the running average ``old`` (None: nothing before)."""
    return new if old is None else (1 - weight) * old + weight * new


@dataclass
class Running:
    """A running average (:func:`ewma`) of one measured value, and how often it was fed."""

    value: float = 0.0
    runs: int = 0
    measured_at: int = -1  # the caller's counter at the last measurement
    seeded: int = 0  # of ``runs``, those taken from the fleet's figures (not measured here)

    @property
    def own(self) -> int:
        """Measurements made here (not taken from the fleet's figures)."""
        return self.runs - self.seeded

    def update(self, value: float, at: int = -1, weight: float = EWMA) -> None:
        self.value = ewma(self.value if self.runs else None, value, weight)
        self.runs += 1
        self.measured_at = at


@dataclass
class AffineCost:
    """Seconds as an affine function of a size, fitted (least squares, slope >= 0) to a
    running average of the measurements at each size."""

    seen: dict[int, float] = field(default_factory=dict)

    def record(self, size: int, seconds: float, weight: float = EWMA) -> None:
        self.seen[size] = ewma(self.seen.get(size), seconds, weight)

    def predict(self, size: int) -> float:
        """Predicted seconds (0 with nothing measured; flat with one size measured; never
        below half the cheapest measurement)."""
        points = list(self.seen.items())
        if len(points) < 2:
            return points[0][1] if points else 0.0
        n = len(points)
        mx = sum(x for x, _ in points) / n
        my = sum(y for _, y in points) / n
        var = sum((x - mx) ** 2 for x, _ in points)
        slope = max(sum((x - mx) * (y - my) for x, y in points) / var, 0.0)
        return max(my + slope * (size - mx), min(y for _, y in points) * 0.5)


@dataclass
class Acceptance:
    """Draft tokens accepted and rejections, slowly forgotten."""

    accepted: float = 0.0
    rejected: float = 0.0

    @property
    def seen(self) -> bool:
        return self.accepted + self.rejected > 0

    def add(self, accepted: float, rejections: float, fade: float = FADE) -> None:
        """Feed draft tokens accepted and rejections (rounds that stopped before their
        last proposal), what came before fading by ``fade``."""
        self.accepted = fade * self.accepted + accepted
        self.rejected = fade * self.rejected + rejections

    def update(self, accepted: int, proposed: int) -> None:
        """Feed one round: ``accepted`` of ``proposed`` draft tokens."""
        if proposed > 0:
            self.add(accepted, 1.0 if accepted < proposed else 0.0)

    def rate(self, prior: float, weight: float = 1.0) -> float:
        """p, the chance the next draft token is accepted (the geometric model's
        estimate, accepted / (accepted + rejections)), shrunk towards ``prior`` by
        ``weight`` pseudo-observations."""
        seen = self.accepted + self.rejected + weight
        return (self.accepted + weight * prior) / seen if seen > 0 else prior


def expected_tokens(p: float, k: int) -> float:
    """Tokens a round drafting k emits at per-token acceptance p (accepted + 1)."""
    if p >= 1.0:
        return k + 1.0
    return (1 - p ** (k + 1)) / (1 - p)
