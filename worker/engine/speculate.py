"""The rules of speculative decoding, one copy for every path (alone and batched, with
a draft model or prompt lookup: ``worker.engine.specbatch``).

Each round a proposer offers up to k tokens (a draft model, one pass each, or the
sequence's own text); the target verifies them in one pass of k + 1 tokens and the
sequence keeps the proposals while they equal the target's own tokens (greedy:
exactly what the target alone would write), then the target's token
(:func:`accepted`). Counting is honest: a proposal counts once the sequence reaches
its position; proposals past a sequence's end count as neither accepted nor rejected
(:func:`counted`). A draft then has to see every token since its last pass
(:func:`draft_unseen`). A job measuring the policy stops proposing once it runs
slower than plain (:class:`GiveUp`).

Pure Python; knows nothing of MLX, Redis or jobs.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence


def accepted(chosen: list[int], proposed: list[int], num: int) -> int:
    """How many of the first ``num`` proposals the target keeps: each while it equals the
    token the target chose at its position (greedy: exactly what the target alone would
    write). The target's own token at position ``a`` follows them."""
    a = 0
    while a < num and chosen[a] == proposed[a]:
        a += 1
    return a


def counted(j: int, a: int, num: int) -> tuple[int, int, int]:
    """(proposed, accepted, rejections) that emitting position ``j`` of a round that kept
    ``a`` of ``num`` proposals adds: a kept proposal counts once the sequence reaches it;
    the target's token counts the rest as proposed, and the round as a rejection if it
    rejected one. Proposals past a sequence's end count as neither."""
    return (1, 1, 0) if j < a else (num - a, 0, int(a < num))


def draft_unseen(
    proposed: list[int], chosen: list[int], a: int, restored: bool, unseen: list[int]
) -> list[int]:
    """What a draft has still to see after a round that kept ``a`` of ``proposed`` (then
    ``chosen[a]``): every token since its last pass. ``unseen``: what it had to see
    before the round; ``restored``: its cache went back to after its first pass."""
    num = len(proposed)
    if num == 0:  # it did not run: this token is unseen as well
        return [*unseen, chosen[0]]
    if restored:  # the kept tokens go next
        return chosen[: a + 1]
    return [proposed[-1], chosen[a]] if a == num else [chosen[a]]


#: Tokens a measuring job speculates before :class:`GiveUp` may judge it.
GIVE_UP_AFTER = 16


class GiveUp:
    """A job alone's draft planner (``worker.engine.protocol.DraftPlanner``): k each round
    until, ``after`` tokens in, it measures slower speculating than ``plain_tps``
    (tokens/s); then 0 for good: a measurement that already says its arm loses is not
    paid to the end of the job. What was measured until then stands (``spec_tokens``,
    ``spec_s``)."""

    def __init__(self, k: int, plain_tps: float, after: int = GIVE_UP_AFTER) -> None:
        self.k, self.plain_tps, self.after = k, plain_tps, after
        self.spec_tokens, self.spec_s, self.gave_up = 0, 0.0, False

    def plan(self, tags: Sequence[Hashable], remaining: Sequence[int]) -> int:
        if not self.gave_up and self.spec_tokens >= self.after:
            self.gave_up = self.spec_tokens < self.plain_tps * self.spec_s
        return 0 if self.gave_up else self.k

    def observe(
        self,
        tags: Sequence[Hashable],
        accepted: Sequence[int],
        proposed: Sequence[int],
        k: int,
        times: tuple[float, float, float],
        emitted: int,
    ) -> None:
        if not self.gave_up:  # a round's tokens and seconds, rewinding included
            self.spec_tokens += emitted
            self.spec_s += times[2]
