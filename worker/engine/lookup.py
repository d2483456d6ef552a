"""Prompt lookup: draft tokens copied from the sequence's own text, no draft model.

A round proposes the tokens that followed the sequence's last n tokens where those n
occurred before, in the prompt or in what it generated: the longest n first
(``ngram_max`` down to ``ngram_min``), its latest occurrence first. Once a span is
being copied, the copy goes on from where it is (as long as what the target wrote
since follows that span) rather than from the latest occurrence of the last n tokens:
structured text repeats short n-grams ("", "name": ...) everywhere, and the span being
quoted is the one that predicts what comes next. Copy-heavy work
(extraction, quoting, rewriting structured text, code edits) repeats long spans of
its prompt, which the target then verifies in one pass as it verifies a draft
model's tokens (``worker.engine.speculate``, ``worker.engine.specbatch``). The
proposals are fixed tokens, not samples, so the acceptance rule (keep a proposal
while it equals the token the target samples there) leaves sampled output
distributed exactly as the target's own.

An index kept as the sequence grows makes each lookup cost ``ngram_max`` dictionary
probes, whatever the length of the sequence. Pure Python.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from schemas.request import MAX_NGRAM, MAX_PROPOSAL, Speculation


@dataclass(frozen=True)
class Lookup:
    """How a sequence looks up its proposals: n-gram sizes tried (longest first) and the
    most tokens one round proposes."""

    ngram_min: int = 2
    ngram_max: int = 4
    num_tokens: int = MAX_PROPOSAL  # (the round's k caps it too: the policy's, or this)

    def __post_init__(self) -> None:
        for name in ("ngram_min", "ngram_max"):
            n = getattr(self, name)
            if not 1 <= n <= MAX_NGRAM:
                raise ValueError(f"prompt lookup: {name} must be 1-{MAX_NGRAM}, not {n}")
        if self.ngram_min > self.ngram_max:
            raise ValueError(
                f"prompt lookup: ngram_min {self.ngram_min} > ngram_max {self.ngram_max}"
            )
        if not 1 <= self.num_tokens <= MAX_PROPOSAL:
            raise ValueError(
                f"prompt lookup: num_tokens must be 1-{MAX_PROPOSAL}, not {self.num_tokens}"
            )


#: Prompt lookup's settings where a job sets none.
DEFAULT_LOOKUP = Lookup()


def lookup_for(spec: Speculation | None) -> Lookup:
    """A job's lookup settings: what its ``speculation`` sets, the defaults for the rest."""
    if spec is None or spec.method != "prompt_lookup":
        return DEFAULT_LOOKUP
    default = DEFAULT_LOOKUP
    lo = spec.ngram_min or min(default.ngram_min, spec.ngram_max or MAX_NGRAM)
    hi = spec.ngram_max or max(default.ngram_max, lo)
    return Lookup(lo, hi, spec.num_tokens or default.num_tokens)


class NgramIndex:
    """A growing token sequence and, for each n-gram size, where each n-gram last
    occurred with a token after it."""

    def __init__(self, lookup: Lookup, tokens: Iterable[int] = ()) -> None:
        self.lookup = lookup
        self.tokens: list[int] = []
        self._sizes = range(lookup.ngram_min, lookup.ngram_max + 1)
        self._last: list[dict[tuple[int, ...], int]] = [{} for _ in self._sizes]
        self._copy: tuple[int, int] | None = None  # (source position, sequence length) then
        self.extend(tokens)

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, tokens: Iterable[int]) -> None:
        """Append ``tokens``: each makes the n-grams just before it ones with a successor."""
        seq, last = self.tokens, self._last
        for t in tokens:
            seq.append(int(t))
            end = len(seq) - 1  # the new token's position: what follows each n-gram before it
            for n, table in zip(self._sizes, last, strict=True):
                if end >= n:
                    table[tuple(seq[end - n : end])] = end

    def sync(self, history: list[int]) -> None:
        """Catch up with ``history``, the sequence this index follows (it only grows)."""
        if len(history) > len(self.tokens):
            self.extend(history[len(self.tokens) :])

    def propose(self, limit: int) -> list[int]:
        """Up to ``limit`` tokens that followed the sequence's last n tokens where they last
        occurred before (the longest n that occurred); [] when none did."""
        seq, end = self.tokens, len(self.tokens)
        if limit < 1:
            return []
        limit = min(limit, self.lookup.num_tokens)
        if self._copy is not None:  # the span being copied, if the sequence still follows it
            source, then = self._copy
            grown = end - then
            if seq[source : source + grown] == seq[then:end] and source + grown < end:
                self._copy = (source + grown, end)
                return seq[source + grown : source + grown + limit]
        self._copy = None
        for n, table in zip(reversed(self._sizes), reversed(self._last), strict=True):
            if end < n:
                continue
            at = table.get(tuple(seq[-n:]))
            if at is not None:
                self._copy = (at, end)
                return seq[at : at + limit]
        return []
