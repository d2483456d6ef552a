"""``logprobs`` / ``top_logprobs``: each completion token's log-probability, OpenAI's shape.

The values are the target model's log-probabilities after the job's logits
processors (bias, penalties, the response_format mask): what mlx-lm samples from,
before temperature. Every path collects them the same way, from the vector mlx-lm
hands out with each token: one at a time, speculative (an accepted draft token
carries the target's vector from verification), batched, streamed.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

from schemas.result import ChoiceLogprobs, TokenLogprob, TopLogprob

#: One token: (id, logprob, ((id, logprob), ...) best first).
LogprobEntry = tuple[int, float, tuple[tuple[int, float], ...]]


@dataclass
class LogprobCollector:
    """Collects entries token by token; ``ends`` is the text length after each one."""

    top: int
    entries: list[LogprobEntry] = field(default_factory=list)
    ends: list[int] = field(default_factory=list)

    def add(self, token: int, logprobs: mx.array, text_end: int) -> None:
        lp = logprobs.reshape(-1)
        chosen = lp[token]
        if self.top:
            idx = mx.argpartition(-lp, self.top - 1)[: self.top]
            vals = lp[idx]
            mx.eval(chosen, idx, vals)
            pairs = sorted(zip(idx.tolist(), vals.tolist(), strict=True), key=lambda p: -p[1])
            # A token a mask forbids (-inf) is no alternative (and not JSON): left out.
            top = tuple((int(i), float(v)) for i, v in pairs if v != -math.inf)
        else:
            top = ()
        self.entries.append((int(token), float(chosen.item()), top))
        self.ends.append(text_end)

    def covered(self, upto: int, start: int = 0) -> int:
        """How many leading tokens have all their text within ``text[:upto]`` (the first
        ``start`` are known to)."""
        n = start
        while n < len(self.ends) and self.ends[n] <= upto:
            n += 1
        return n

    def kept(self, text_len: int, cut: bool) -> tuple[LogprobEntry, ...]:
        """The entries of the tokens in the final text (EOS is never added): after a
        stop string cut the text at ``text_len``, only tokens that began before it."""
        if not cut:
            return tuple(self.entries)
        starts = [0, *self.ends[:-1]]
        return tuple(e for e, s in zip(self.entries, starts, strict=True) if s < text_len)


def render(entries: Sequence[LogprobEntry], token_bytes: Callable[[int], bytes]) -> ChoiceLogprobs:
    """OpenAI's ``choices[].logprobs`` for ``entries``."""

    def one(token: int, logprob: float) -> dict[str, Any]:
        raw = token_bytes(token)
        return {"token": raw.decode("utf-8", "replace"), "logprob": logprob, "bytes": list(raw)}

    content = [
        TokenLogprob(**one(t, lp), top_logprobs=[TopLogprob(**one(i, v)) for i, v in top])
        for t, lp, top in entries
    ]
    return ChoiceLogprobs(content=content)
