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
rejections, slowly forgotten, shrunk towards the batch's pooled acceptance). Pure
Python; the engine (``worker.engine.specbatch``) times its passes and asks (``plan``).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

from worker.schedule.estimators import EWMA, Acceptance, AffineCost, ewma, expected_tokens

#: Pseudo-observations of the pooled acceptance in each row's estimate.
PRIOR = 1.0
#: After this many rounds in a row without drafting, one round drafts a token (k=1),
#: so the acceptance estimates still see the draft.
PROBE_AFTER = 8
#: Rounds at the largest k a batch starts with (before one plain round): a draft often
#: disagrees with the first token after a prompt, so one round says little.
START_ROUNDS = 2

#: A pass's cost: seconds, a line in the tokens it processes.
PassCost = AffineCost

__all__ = ["EWMA", "PRIOR", "Acceptance", "Goodput", "PassCost", "expected_tokens"]


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
        self.rows: dict[Hashable, Acceptance] = {}  # each row's own acceptance

    def plan(self, tags: Sequence[Hashable], remaining: Sequence[int]) -> int:
        """This round's k for the rows ``tags`` (with ``remaining`` tokens left each)."""
        self.rows = {t: self.rows.get(t) or Acceptance() for t in tags}
        return self.choose([self.rows[t] for t in tags], list(remaining))

    def observe(
        self,
        tags: Sequence[Hashable],
        accepted: Sequence[int],
        proposed: Sequence[int],
        k: int,
        times: tuple[float, float, float],
        emitted: int,
    ) -> None:
        """Feed one round: per row, draft tokens ``accepted`` of ``proposed``; the
        round's k; its (draft, verify, total) seconds; the tokens it emitted."""
        for tag, a, n in zip(tags, accepted, proposed, strict=True):
            self.rows.setdefault(tag, Acceptance()).update(a, n)
        if k:
            rejections = sum(a < n for a, n in zip(accepted, proposed, strict=True))
            self.pooled.add(sum(accepted), rejections)  # the round's totals
        self.measured(len(tags), k, *times, emitted)

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
            self.per_token = ewma(self.per_token or None, rest)
