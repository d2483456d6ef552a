"""One sequence alone, plain or speculative, behind the engine interface.

Pure MLX and mlx-lm; knows nothing of Redis or jobs. Plain decoding is mlx-lm's
own loop (``stream_generate``); speculative decoding is mlxq's
(:mod:`worker.engine.speculate`), with a draft model or prompt lookup
(:mod:`worker.engine.lookup`), exact on every cache type where mlx-lm's is exact
on plain KV caches only. Both are token sources that :class:`SingleEngine` steps
one token at a time through the one sequence type (``worker.engine.sequence``),
so a job alone runs as any engine does (``worker.engine.protocol.run_to_end``).
"""

from __future__ import annotations

from collections.abc import Generator, Hashable, Iterator
from typing import Any

import mlx.core as mx
from mlx_lm.generate import stream_generate

from schemas import MlxqError
from worker.engine.layers import count as cache_count
from worker.engine.layers import nbytes
from worker.engine.lookup import Lookup, NgramIndex
from worker.engine.models import LoadedModel
from worker.engine.output import GenerationOutput
from worker.engine.prefill import PREFILL_STEP
from worker.engine.protocol import NO_START, CannotTake, Start, Step
from worker.engine.request import Prepared
from worker.engine.sampling import logits_processors, plain_sampler
from worker.engine.sequence import OnText, Sequence
from worker.engine.speculate import (
    DraftProposer,
    GiveUp,
    LookupProposer,
    Proposer,
    Tally,
    speculative_tokens,
)

#: One token from a source: (token, finish reason if mlx-lm's loop ends there, logprobs).
Emitted = tuple[int, str | None, mx.array]


class SingleEngine:
    """One sequence on a target, decoded plainly, or speculatively with ``draft`` (its
    proposals capped by the job's ``num_draft_tokens``) or prompt ``lookup`` (the draft
    is then not used). With ``give_up_below`` (tokens/s), speculation stops for the rest
    of the job once it measures slower than that (:class:`~worker.engine.speculate.GiveUp`).
    Greedy output is the same with or without speculation.

    Each :meth:`step` emits one token; the first also prefills the prompt (from
    ``start``'s kept prefix: the target's layers, then the draft's).
    """

    def __init__(
        self,
        target: LoadedModel,
        draft: LoadedModel | None = None,
        lookup: Lookup | None = None,
        give_up_below: float | None = None,
    ) -> None:
        self.target = target
        self.draft = draft if lookup is None else None
        self.lookup, self.give_up_below = lookup, give_up_below
        self.models = (target,) if self.draft is None else (target, self.draft)
        self._seq: Sequence | None = None
        self._tokens: Iterator[Emitted] | None = None
        self._cache: list[Any] = []
        self._tally: Tally | None = None  # speculative: its draft counts
        self._eos: frozenset[int] = frozenset()
        self._last: Any = None  # mlx-lm's last response (its measured speeds)

    def __len__(self) -> int:
        return 0 if self._seq is None else 1

    @property
    def kv_bytes(self) -> int:
        return nbytes(self._cache) if self._seq is not None else 0

    @property
    def speculative(self) -> bool:
        return self.draft is not None or self.lookup is not None

    def add(
        self,
        tag: Hashable,
        job: Prepared,
        start: Start = NO_START,
        on_text: OnText | None = None,
        first: bool = False,
    ) -> None:
        """``job``'s sequence (the only one: a second raises :class:`CannotTake`)."""
        if self._seq is not None:
            raise CannotTake("a job alone is one sequence: this engine holds one already")
        prompt, params = job.prompt, job.params
        if params.seed is not None:
            mx.random.seed(params.seed)
        mx.reset_peak_memory()
        self._tally, self._last = None, None
        model = self.target.model
        n_t = cache_count(model)
        cache, cached = start.cache, start.cached
        t_cache = cache[:n_t] if cache is not None else self.target.new_cache()
        self._seq = Sequence(
            tag, len(prompt), params, self.target.tokenizer.detokenizer, start.reused, on_text
        )
        if not self.speculative:
            self._cache = t_cache
            self._tokens = self._plain(job, t_cache, cached)
            return
        proposer: Proposer
        if self.draft is not None:
            d_model = self.draft.model
            d_cache = cache[n_t:] if cache is not None else self.draft.new_cache()
            self._cache = [*t_cache, *d_cache]
            proposer = DraftProposer(d_model, d_cache, prompt, cached)
        else:
            assert self.lookup is not None
            self._cache = t_cache
            proposer = LookupProposer(NgramIndex(self.lookup, prompt))
        self._eos = frozenset(int(t) for t in self.target.tokenizer.eos_token_ids)
        self._tally = tally = Tally()
        if self.give_up_below is not None:
            proposer = GiveUp(proposer, tally, self.give_up_below)
        self._tokens = self._speculated(job, proposer, t_cache, cached, tally)

    def _plain(self, job: Prepared, cache: list[Any], cached: int) -> Iterator[Emitted]:
        params = job.params
        for r in stream_generate(
            self.target.model,
            self.target.tokenizer,
            mx.array(job.prompt[cached:]),
            max_tokens=params.max_tokens,
            sampler=plain_sampler(params),
            logits_processors=logits_processors(params),
            prefill_step_size=PREFILL_STEP,
            prompt_cache=cache,
        ):
            self._last = r
            yield int(r.token), r.finish_reason, r.logprobs

    def _speculated(
        self, job: Prepared, proposer: Proposer, cache: list[Any], cached: int, tally: Tally
    ) -> Iterator[Emitted]:
        params = job.params
        tokens = speculative_tokens(
            self.target.model,
            proposer,
            job.prompt,
            k=params.num_draft_tokens,
            max_tokens=params.max_tokens,
            sampler=plain_sampler(params),
            processors=logits_processors(params),
            target_cache=cache,
            cached=cached,
            tally=tally,
        )
        try:
            for t in tokens:
                yield t.token, None, t.logprobs  # its end: the sequence's rule (emit)
        finally:
            tokens.close()

    def step(self) -> Step:
        """The sequence's next token (the first step prefills its prompt too)."""
        seq, tokens = self._seq, self._tokens
        if seq is None or tokens is None:
            return Step(0, [], False)
        prefilling = seq.first_token_at is None
        item = next(tokens, None)
        if item is None:
            finish: str | None = "length"
        elif (tally := self._tally) is not None:
            finish = seq.emit(item[0], self._eos, item[2])
            seq.draft_proposed, seq.draft_accepted = tally.proposed, tally.accepted
            seq.draft_rejections, seq.idle_rounds = tally.rejections, tally.idle
            seq.gave_up = tally.gave_up
        else:
            finish = seq.advance(*item)
        if finish is None:
            return Step(1, [], prefilling)
        return Step(0 if item is None else 1, [(seq.tag, self._finish(finish))], prefilling)

    def _finish(self, reason: str) -> GenerationOutput | MlxqError:
        seq, tally = self._seq, self._tally
        assert seq is not None
        self.close()  # ends the token source (a speculative one counts its last round)
        if tally is not None:
            seq.speculated = (tally.spec_tokens, tally.spec_s)
            return seq.finish(reason)
        if self._last is None:
            raise RuntimeError("mlx-lm produced no tokens")
        return seq.finish(reason, self._last.prompt_tps, self._last.generation_tps)

    def remove(self, tag: Hashable) -> None:
        if self._seq is not None and self._seq.tag == tag:
            self.close()

    def lengths(self) -> list[tuple[int, int]]:
        return [] if self._seq is None else [self._seq.length()]

    def first_token_at(self, tag: Hashable) -> float | None:
        seq = self._seq
        return seq.first_token_at if seq is not None and seq.tag == tag else None

    def close(self) -> None:
        if isinstance(self._tokens, Generator):
            self._tokens.close()
        self._seq, self._tokens, self._cache = None, None, []
