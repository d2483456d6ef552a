"""One sequence being generated: the one type every engine advances, token by token.

Whatever makes the tokens (a job alone, plain (mlx-lm's loop) or speculative (mlxq's);
a continuous batch; a speculative batch; the n choices of one prompt), each token
goes through :meth:`Sequence.advance`, which applies what a job asked for in one
place: EOS, ``max_tokens``, stop strings (the text is cut before the earliest),
logprobs, streamed pieces (text that could still begin a stop string is held back
until it cannot), and the draft tokens it was proposed and accepted. When it ends,
:meth:`Sequence.finish` checks the grammar (``response_format``) and makes its
:class:`~worker.engine.output.GenerationOutput`; one stopped mid-way (a cancel, a time
limit) gives what it made so far (:meth:`Sequence.cut_short`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

from schemas import MlxqError
from worker.engine.constrain import verify
from worker.engine.logprobs import LogprobCollector, LogprobEntry
from worker.engine.output import GenerationOutput
from worker.engine.request import GenerationParams

#: Receives streamed text in pieces that concatenate to exactly the final text, each
#: with the logprob entries of the tokens whose text it completes.
OnText = Callable[[str, Seq[LogprobEntry]], None]

#: The finish reason of a sequence stopped mid-way (:meth:`Sequence.cut_short`).
CUT = "cut"


class StopScan:
    """Finds stop strings in text that grows at its end (one scan per new piece)."""

    def __init__(self, stops: Seq[str]) -> None:
        self.stops = tuple(stops)
        self.longest = max((len(s) for s in self.stops), default=0)

    def find(self, text: str, grown_from: int) -> int:
        """Index of the earliest stop string in ``text`` that may end after ``grown_from``
        (where the text was before its newest piece); -1 if none."""
        if not self.stops:
            return -1
        start = max(0, grown_from - self.longest + 1)
        hits = [i for s in self.stops if (i := text.find(s, start)) >= 0]
        return min(hits) if hits else -1

    def which(self, text: str, at: int) -> str | None:
        """The stop string found at ``at`` (:meth:`find`'s index): the longest there."""
        return max((s for s in self.stops if text.startswith(s, at)), key=len, default=None)

    def safe(self, text: str) -> int:
        """How much of ``text`` can be shown: what follows could still begin a stop string."""
        return len(text) - max(self.longest - 1, 0)


@dataclass
class Sequence:
    """One sequence, and what it has produced so far."""

    tag: Hashable
    prompt_len: int
    params: GenerationParams
    detokenizer: Any  # a fresh streaming detokenizer of the model's tokenizer
    cached_tokens: int = 0  # prompt tokens reused from the prefix cache
    on_text: OnText | None = None  # streamed: receives the text as it grows
    admitted_at: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    text: str = ""
    tokens: list[int] = field(default_factory=list)
    draft_proposed: int = 0
    draft_accepted: int = 0
    draft_rejections: int = 0  # rounds that stopped before their last proposal
    idle_rounds: int = 0  # speculative rounds with nothing proposed (a lookup's miss)
    gave_up: bool = False  # speculation stopped mid-job: it measured slower than plain
    speculated: tuple[int, float] = (0, 0.0)  # (tokens, seconds) while speculating
    cut: bool = False  # a stop string cut the text
    collector: LogprobCollector | None = field(init=False)
    _scan: StopScan = field(init=False)
    stop_hit: str | None = None  # the stop string that ended it, if one did
    _shown: int = 0  # text streamed so far (characters)
    _shown_entries: int = 0  # logprob entries streamed so far

    def __post_init__(self) -> None:
        self._scan = StopScan(self.params.stop)
        top = self.params.logprobs
        self.collector = LogprobCollector(top) if top is not None else None
        # Nothing reads the text before the end (no stop string, stream or logprobs):
        # the detokenizer takes each token and is read once, when the sequence ends.
        # Its pieces concatenate to the same text; reading one per token costs a decode
        # of the whole text so far with mlx-lm's naive detokenizer.
        self._lazy = not self.params.stop and self.on_text is None and self.collector is None

    @property
    def left(self) -> int:
        """Tokens it may still add."""
        return self.params.max_tokens - len(self.tokens)

    def length(self) -> tuple[int, int]:
        """(tokens in its KV cache, tokens it may still add): what admission projects."""
        return self.prompt_len + len(self.tokens), self.left

    def advance(
        self, token: int, finish_reason: str | None, logprobs: mx.array | None
    ) -> str | None:
        """Add ``token`` (with the log-probability vector it was sampled from); the finish
        reason if the sequence ends here. ``finish_reason`` is what the token generator
        knows ("stop": ``token`` is EOS, not part of the text; "length"); a stop string
        is found here."""
        if self.first_token_at is None:
            self.first_token_at = time.perf_counter()
        self.tokens.append(token)
        if finish_reason == "stop":  # EOS: not part of the text
            self.detokenizer.finalize()
            self.text += self.detokenizer.last_segment
            return "stop"
        grown_from = len(self.text)
        self.detokenizer.add_token(token)
        if finish_reason == "length":
            self.detokenizer.finalize()
        elif self._lazy:
            return finish_reason
        self.text += self.detokenizer.last_segment
        if self.collector is not None and logprobs is not None:
            self.collector.add(token, logprobs, len(self.text))
        if (at := self._scan.find(self.text, grown_from)) >= 0:
            self.stop_hit = self._scan.which(self.text, at)
            self.text, self.cut = self.text[:at], True
            return "stop"
        self._stream()
        return finish_reason

    def emit(self, token: int, eos: frozenset[int], logprobs: mx.array | None) -> str | None:
        """:meth:`advance` for a token mlxq's own loops chose (the speculative ones, alone
        and batched): it ends the sequence as EOS ("stop") or as its last ("length")."""
        at_limit = len(self.tokens) + 1 >= self.params.max_tokens
        reason = "stop" if token in eos else ("length" if at_limit else None)
        return self.advance(token, reason, logprobs)

    def _stream(self) -> None:
        """Hand ``on_text`` what can be shown now."""
        if self.on_text is None or (safe := self._scan.safe(self.text)) <= self._shown:
            return
        c, sent = self.collector, self._shown_entries
        done = c.covered(safe, sent) if c is not None else 0
        self.on_text(self.text[self._shown : safe], c.entries[sent:done] if c else ())
        self._shown, self._shown_entries = safe, max(sent, done)

    def kept_logprobs(self) -> tuple[LogprobEntry, ...] | None:
        return self.collector.kept(len(self.text), self.cut) if self.collector else None

    def finish(
        self,
        reason: str,
        prompt_tps: float | None = None,
        generation_tps: float | None = None,
    ) -> GenerationOutput | MlxqError:
        """The sequence ended with ``reason``: the rest of its streamed text, then its
        output, or what fails it (output that does not follow its grammar). Speeds are
        measured here unless the token generator measured them (``*_tps``)."""
        if self._lazy:  # the rest of the text (nothing if EOS or the length read it)
            self.text += self.detokenizer.last_segment
        kept = self.kept_logprobs()
        if self.on_text is not None:
            sent = self._shown_entries
            if len(self.text) > self._shown or (kept and len(kept) > sent):
                self.on_text(self.text[self._shown :], kept[sent:] if kept else ())
            self._shown = len(self.text)
        if self.params.constraint is not None:
            try:
                verify(self.params.constraint, self.tokens, reason)
            except MlxqError as e:
                return e
        return self._output(reason, kept, prompt_tps, generation_tps)

    def cut_short(self) -> GenerationOutput:
        """What the sequence made before it was stopped mid-way (a cancel, a time limit):
        its text so far (nothing more streamed, its grammar not checked: it is cut), its
        tokens and speeds, with the finish reason :data:`CUT`."""
        if self._lazy:
            self.text += self.detokenizer.last_segment
        return self._output(CUT, self.kept_logprobs())

    def _output(
        self,
        reason: str,
        kept: tuple[LogprobEntry, ...] | None,
        prompt_tps: float | None = None,
        generation_tps: float | None = None,
    ) -> GenerationOutput:
        end = time.perf_counter()
        first = self.first_token_at or end
        n = len(self.tokens)
        if prompt_tps is None:
            prompt_tps = self.prompt_len / max(first - self.admitted_at, 1e-9)
        if generation_tps is None:
            generation_tps = n / max(end - first, 1e-9) if n > 1 else 0.0
        return GenerationOutput(
            text=self.text,
            finish_reason=reason,
            stop_sequence=self.stop_hit if reason == "stop" else None,
            prompt_tokens=self.prompt_len,
            completion_tokens=n,
            time_to_first_token_s=first - self.admitted_at,
            prompt_tokens_per_s=prompt_tps,
            generation_tokens_per_s=generation_tps,
            total_time_s=end - self.admitted_at,
            draft_tokens_proposed=self.draft_proposed,
            draft_tokens_accepted=self.draft_accepted,
            draft_rejections=self.draft_rejections,
            idle_rounds=self.idle_rounds,
            gave_up_after=self.speculated[0] if self.gave_up else 0,
            speculated_s=self.speculated[1],
            peak_memory_gb=mx.get_peak_memory() / 1e9,
            token_ids=tuple(self.tokens),
            cached_tokens=self.cached_tokens,
            logprobs=kept,
            in_reasoning=self.params.in_reasoning,
        )
