"""How many tokens a speculative batch should draft this round: goodput.

A speculative round costs k draft passes over the batch, one target pass over
B x (k + 1) tokens, and bookkeeping per emitted token; it emits, for each row,
its accepted draft tokens plus one, which depends on how well the draft predicts
that row's text. The best k is the one with the most expected tokens per second
of round ("goodput", as in SmartSpec, Liu et al. 2024, arXiv:2406.14066), and it
changes as the batch changes:

- a compute-bound target (this CPU, or a big batch on a GPU) pays for every
  verified token, so k shrinks as the batch grows, down to 0 (a plain step);
- rows whose draft stops agreeing with them (the tail of a queue, where the rows
  left are often those the draft predicts worst) pull k down, so they are not
  verified k + 1 wide for one token each.

Everything comes from measurement in the running batch: pass times (an affine
fit in the tokens a pass processes, over recent measurements at each size),
bookkeeping per token, and each row's acceptance (accepted draft tokens and
rejections, slowly forgotten, shrunk towards the batch's pooled acceptance).
Pure Python; the engine (``worker.specbatch``) times its passes and asks.
"""

from __future__ import annotations

from dataclasses import dataclass

#: Weight of a new measurement in a pass time's running average.
EWMA = 0.3
#: Per round, the share of a row's past acceptance evidence that is kept.
FADE = 0.9
#: Pseudo-observations of the pooled acceptance in each row's estimate.
PRIOR = 1.0
#: After this many rounds in a row without drafting, one round drafts a token (k=1),
#: so the acceptance estimates still see the draft.
PROBE_AFTER = 8
#: Rounds at the largest k a batch starts with (before one plain round): a draft often
#: disagrees with the first token after a prompt, so one round says little.
START_ROUNDS = 2


class PassCost:
    """Seconds of a forward pass, an affine function of the tokens it processes, fitted
    (least squares) to a running average of measured passes at each token count."""

    def __init__(self) -> None:
        self.seen: dict[int, float] = {}

    def record(self, tokens: int, seconds: float) -> None:
        old = self.seen.get(tokens)
        self.seen[tokens] = seconds if old is None else (1 - EWMA) * old + EWMA * seconds

    def predict(self, tokens: int) -> float:
        """Predicted seconds (0 with nothing measured; flat with one size measured)."""
        points = list(self.seen.items())
        if len(points) < 2:
            return points[0][1] if points else 0.0
        n = len(points)
        mx = sum(x for x, _ in points) / n
        my = sum(y for _, y in points) / n
        var = sum((x - mx) ** 2 for x, _ in points)
        slope = max(sum((x - mx) * (y - my) for x, y in points) / var, 0.0)
        return max(my + slope * (tokens - mx), min(y for _, y in points) * 0.5)


@dataclass
class Acceptance:
    """Draft tokens accepted and rejections, slowly forgotten (per row, and pooled)."""

    accepted: float = 0.0
    rejected: float = 0.0

    def add(self, accepted: float, rejections: float) -> None:
        """Feed one round: draft tokens accepted, and rejections (rounds of a row that
        stopped before its last proposal), what came before fading."""
        self.accepted = FADE * self.accepted + accepted
        self.rejected = FADE * self.rejected + rejections

    def update(self, accepted: int, proposed: int) -> None:
        """Feed one row's round: ``accepted`` of ``proposed`` draft tokens."""
        if proposed > 0:
            self.add(accepted, 1.0 if accepted < proposed else 0.0)

    def rate(self, prior: float, weight: float = PRIOR) -> float:
        """p, the chance the next draft token is accepted (the geometric model's
        estimate, accepted / (accepted + rejections)), shrunk towards ``prior``."""
        seen = self.accepted + self.rejected + weight
        return (self.accepted + weight * prior) / seen if seen > 0 else prior


def expected_tokens(p: float, k: int) -> float:
    """Tokens a row emits in a round drafting k at per-token acceptance p (accepted + 1)."""
    if p >= 1.0:
        return k + 1.0
    return (1 - p ** (k + 1)) / (1 - p)


class Goodput:
    """Chooses each round's k for a speculative batch and learns from what it measures."""

    def __init__(self, cap: int, prior: float | None = None) -> None:
        """``prior``: the pair's acceptance measured elsewhere (one job at a time), if
        known; the batch's own measurements take over as they come."""
        self.cap = cap
        self.target = PassCost()  # by tokens verified (B x (k + 1))
        self.draft = PassCost()  # by rows (one draft pass over the batch)
        self.per_token = 0.0  # seconds of bookkeeping per emitted token
        p = 0.5 if prior is None else min(max(prior, 0.0), 0.99)
        self.pooled = Acceptance(2 * p, 2 * (1 - p))  # worth two rounds
        self.plain_streak = 0
        self.chosen: dict[int, int] = {}  # k -> rounds that drafted it

    def choose(self, rows: list[Acceptance], remaining: list[int]) -> int:
        """The k with the most expected tokens per second for these rows (their
        acceptance and tokens left); while the target's cost has been measured at one
        size only, the other end of the range is measured first."""
        b, rounds = len(rows), sum(self.chosen.values())
        if rounds < START_ROUNDS:
            k = self.cap
        elif len(self.target.seen) < 2:
            k = 0 if b * (self.cap + 1) in self.target.seen else self.cap
        elif self.plain_streak >= PROBE_AFTER:
            k = min(1, self.cap)
        else:
            k = self.best(rows, remaining)
        self.plain_streak = self.plain_streak + 1 if k == 0 else 0
        self.chosen[k] = self.chosen.get(k, 0) + 1
        return k

    def best(self, rows: list[Acceptance], remaining: list[int]) -> int:
        prior = self.pooled.rate(0.5, weight=0.0)
        ps = [r.rate(prior) for r in rows]
        b, best_k, best_rate = len(rows), 0, -1.0
        for k in range(self.cap + 1):
            tokens = sum(
                min(expected_tokens(p, min(k, max(left - 1, 0))), left)
                for p, left in zip(ps, remaining, strict=True)
            )
            passes = k * self.draft.predict(b) + self.target.predict(b * (k + 1))
            seconds = passes + self.per_token * tokens
            rate = tokens / seconds if seconds > 0 else tokens
            if rate > best_rate:
                best_k, best_rate = k, rate
        return best_k

    def measured(
        self, rows: int, k: int, draft_s: float, verify_s: float, total_s: float, emitted: int
    ) -> None:
        """Feed one round's times: its k draft passes, its verify pass, and in all."""
        if k:
            self.draft.record(rows, draft_s / k)
        self.target.record(rows * (k + 1), verify_s)
        if emitted:
            rest = max(total_s - draft_s - verify_s, 0.0) / emitted
            old = self.per_token
            self.per_token = rest if not old else (1 - EWMA) * old + EWMA * rest
