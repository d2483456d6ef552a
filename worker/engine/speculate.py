"""Speculative decoding of one sequence, exact on every cache type.

Each round a proposer offers up to k tokens: a draft model (one pass each,
:class:`DraftProposer`) or the sequence's own text (prompt lookup,
:class:`LookupProposer`, no model at all); the target verifies them in one pass
of k + 1 tokens, the sequence keeps the draft's
tokens while they equal the target's own (greedy: exactly what the target
alone would write) and then the target's token, and both caches are rewound
past the rejected tokens with :mod:`worker.engine.rewind`: cut off for KV and
sliding-window layers, restored and replayed over the kept tokens for
recurrent layers (a lookup has no cache to rewind). mlx-lm's own loop
(``speculative_generate_step``) does this for plain KV caches only.

Counting is honest: a draft token counts as proposed only once the sequence
reaches its position (tokens drafted past the end of a sequence count as
neither accepted nor rejected), see :class:`Tally`.

Pure MLX and mlx-lm; knows nothing of Redis or jobs.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import mlx.core as mx
import mlx.nn as nn

from worker.engine import rewind
from worker.engine.lookup import NgramIndex
from worker.engine.prefill import prefill
from worker.engine.sampling import pick as sample

Cache = list[Any]
Sampler = Callable[[mx.array], mx.array]
#: A token (sampled, with its log-probability vector) from logits, given the context.
Pick = Callable[[mx.array, mx.array], tuple[mx.array, mx.array]]


@dataclass
class Tally:
    """Draft tokens of one sequence: proposed (at positions it reached), accepted, and
    rounds that ended on a rejection; plus the replay passes rewinding cost and their
    seconds (recurrent caches only)."""

    proposed: int = 0
    accepted: int = 0
    rejections: int = 0
    rounds: int = 0
    idle: int = 0  # rounds with nothing to propose (prompt lookup found no match)
    spec_tokens: int = 0  # tokens emitted, and seconds, while speculating (not given up)
    spec_s: float = 0.0
    gave_up: bool = False  # it stopped proposing for good (:class:`GiveUp`)
    replays: int = 0
    replay_s: float = 0.0
    verify_s: float = 0.0


@dataclass(frozen=True)
class Token:
    """One token of the sequence, its log-probability vector, and whether the draft
    proposed it."""

    token: int
    logprobs: mx.array
    from_draft: bool


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


class Proposer(Protocol):
    """What offers each round's tokens for the target to verify."""

    def propose(self, num: int, history: list[int], pick: Pick) -> mx.array | None:
        """Up to ``num`` tokens to follow ``history`` (prompt + emitted), lazily evaluated,
        or None for none this round."""
        ...

    def settle(self, proposed: list[int], chosen: list[int], a: int) -> None:
        """After verification: ``a`` of ``proposed`` were kept, then ``chosen[a]``."""
        ...


class DraftProposer:
    """A draft model, one pass per proposed token, its cache rewound past rejections."""

    def __init__(self, model: nn.Module, cache: Cache, prompt: list[int], cached: int) -> None:
        self.model, self.cache = model, cache
        prefill(model, prompt, cache, cached, len(prompt) - 1)
        self.unseen = [prompt[-1]]  # what the draft has not seen yet
        self.replay = rewind.needs_replay(cache)
        self.mark: list[Any] | None = None

    def propose(self, num: int, history: list[int], pick: Pick) -> mx.array | None:
        # The first pass takes what the draft has not seen (kept for good); a cache that
        # its next passes cannot be trimmed back from is checkpointed after it.
        restore = self.replay or rewind.wraps(self.cache, len(self.unseen) + num)
        self.mark = None
        drafts: list[mx.array] = []
        base = mx.array(history, mx.uint32)
        inp = mx.array(self.unseen, mx.uint32)
        for step in range(num):
            logits = self.model(inp[None], cache=self.cache)[:, -1, :]
            if step == 0 and restore and num > 1:
                self.mark = rewind.checkpoint(self.cache, copy=True)
            tok, _ = pick(logits, mx.concatenate([base, *drafts]) if drafts else base)
            mx.async_eval(tok)
            drafts.append(tok)
            inp = tok
        return mx.concatenate(drafts) if drafts else None

    def settle(self, proposed: list[int], chosen: list[int], a: int) -> None:
        num = len(proposed)
        restored = num > 0 and a < num and self.mark is not None
        if restored:  # back to after its first pass
            rewind.restore(self.cache, self.mark)
        elif num > 0 and a < num:
            rewind.trim(self.cache, num - 1 - a)  # (it never saw its last token)
        self.unseen = draft_unseen(proposed, chosen, a, restored, self.unseen)


class LookupProposer:
    """Prompt lookup (``worker.engine.lookup``): no model, nothing to rewind."""

    def __init__(self, index: NgramIndex) -> None:
        self.index = index

    def propose(self, num: int, history: list[int], pick: Pick) -> mx.array | None:
        self.index.sync(history)
        got = self.index.propose(num)
        return mx.array(got, mx.uint32) if got else None

    def settle(self, proposed: list[int], chosen: list[int], a: int) -> None:
        return None


#: Tokens a measuring job speculates before :class:`GiveUp` may judge it.
GIVE_UP_AFTER = 16


class GiveUp:
    """Stops proposing for good once the sequence, ``after`` tokens in, measures slower
    speculating than ``plain_tps`` (tokens/s): a measurement that already says its arm
    loses is not paid to the end of the job. What was measured until then stands."""

    def __init__(
        self, inner: Proposer, tally: Tally, plain_tps: float, after: int = GIVE_UP_AFTER
    ) -> None:
        self.inner, self.tally, self.plain_tps, self.after = inner, tally, plain_tps, after

    def propose(self, num: int, history: list[int], pick: Pick) -> mx.array | None:
        t = self.tally
        if not t.gave_up and t.spec_tokens >= self.after:
            t.gave_up = t.spec_tokens < self.plain_tps * t.spec_s
        return None if t.gave_up else self.inner.propose(num, history, pick)

    def settle(self, proposed: list[int], chosen: list[int], a: int) -> None:
        self.inner.settle(proposed, chosen, a)


def speculative_tokens(
    model: nn.Module,
    proposer: Proposer,
    prompt: list[int],
    *,
    k: int,
    max_tokens: int,
    sampler: Sampler,
    processors: list[Any],
    target_cache: Cache,
    cached: int = 0,
    tally: Tally | None = None,
) -> Iterator[Token]:
    """The tokens of ``prompt``'s continuation, ``max_tokens`` at most, decoded with
    ``proposer`` offering up to ``k`` per round. The target's cache holds the first
    ``cached`` prompt tokens (the rest is prefilled here). Stop iterating to end the
    sequence early."""
    tally = tally if tally is not None else Tally()
    prefill(model, prompt, target_cache, cached, len(prompt) - 1)
    history = list(prompt)  # prompt + tokens emitted
    replay = rewind.needs_replay(target_cache)

    def pick(logits: mx.array, context: list[int] | mx.array) -> tuple[mx.array, mx.array]:
        return sample(logits, context, processors, sampler)

    y = [prompt[-1]]  # what the target has not seen yet
    emitted = 0
    round_at = 0.0  # when the last round started (its tokens: since ``before``)
    before = 0

    def count_round() -> None:  # a round's tokens and seconds, rewinding included
        if round_at and not tally.gave_up:
            tally.spec_tokens += emitted - before
            tally.spec_s += time.perf_counter() - round_at

    while emitted < max_tokens:
        count_round()
        # -- propose: up to k tokens ------------------------------------------------
        round_at, before = time.perf_counter(), emitted
        drafts = proposer.propose(min(k, max_tokens - emitted), history, pick)
        num = 0 if drafts is None else drafts.size
        # -- verify: one target pass over y and the proposals ----------------------
        base = mx.array(history, mx.uint32)
        t_mark = rewind.checkpoint(target_cache) if replay and num else None
        started = time.perf_counter()
        y_in = mx.array(y, mx.uint32)
        verify_in = y_in if drafts is None else mx.concatenate([y_in, drafts])
        logits = model(verify_in[None], cache=target_cache)[0, -(num + 1) :, :]
        if processors:
            picks = [
                pick(logits[j : j + 1], mx.concatenate([base, drafts[:j]]) if j else base)
                for j in range(num + 1)
            ]
            chosen_arr = mx.concatenate([t for t, _ in picks])
            lps = [lp[0] for _, lp in picks]
        else:
            chosen_arr, lp_all = pick(logits, base)
            lps = [lp_all[j] for j in range(num + 1)]
        mx.eval(chosen_arr, *([] if drafts is None else [drafts]))
        tally.verify_s += time.perf_counter() - started
        tally.rounds += 1
        tally.idle += num == 0 and not tally.gave_up
        chosen = chosen_arr.tolist()
        proposed = drafts.tolist() if drafts is not None else []
        a = accepted(chosen, proposed, num)
        # -- emit: accepted proposals, then the target's token ---------------------
        for j in range(a + 1):
            if emitted >= max_tokens:
                break
            history.append(chosen[j])
            emitted += 1
            p, kept, r = counted(j, a, num)
            tally.proposed += p
            tally.accepted += kept
            tally.rejections += r
            yield Token(chosen[j], lps[j], j < a)
        if emitted >= max_tokens:
            count_round()
            return
        # -- rewind the target past what was rejected; the proposer settles --------
        if a < num:
            if t_mark is not None:
                started = time.perf_counter()
                rewind.restore(target_cache, t_mark)
                model(verify_in[None, : a + 1], cache=target_cache)
                mx.eval([c.state for c in target_cache])
                tally.replays += 1
                tally.replay_s += time.perf_counter() - started
            else:
                rewind.cut(target_cache, num - a)
        y = [chosen[a]]
        proposer.settle(proposed, chosen, a)
