"""One sequence alone, decoded plainly, behind the engine interface.

Pure MLX and mlx-lm; knows nothing of Redis or jobs. The tokens are mlx-lm's own
loop's (``stream_generate``); :class:`SingleEngine` steps it one token at a time
through the one sequence type (``worker.engine.sequence``), so a job alone runs as
any engine does (``worker.engine.protocol.run_to_end``). A job alone that speculates
is a speculative engine holding one row (``worker.engine.specbatch``, ``solo``).
"""

from __future__ import annotations

from collections.abc import Generator, Hashable, Iterator
from typing import Any

import mlx.core as mx
from mlx_lm.generate import stream_generate

from schemas import MlxqError
from worker.engine.layers import count as cache_count
from worker.engine.layers import nbytes
from worker.engine.models import LoadedModel
from worker.engine.output import GenerationOutput
from worker.engine.prefill import PREFILL_STEP
from worker.engine.protocol import NO_START, CannotTake, Start, Step
from worker.engine.request import Prepared
from worker.engine.sampling import logits_processors, sampler_for
from worker.engine.sequence import OnText, Sequence

#: One token from mlx-lm's loop: (token, finish reason if it ends there, logprobs).
Emitted = tuple[int, str | None, mx.array]


class SingleEngine:
    """One sequence on a target, decoded plainly. Each :meth:`step` emits one token; the
    first also prefills the prompt (from ``start``'s kept prefix)."""

    def __init__(self, target: LoadedModel) -> None:
        self.target = target
        self.models = (target,)
        self._seq: Sequence | None = None
        self._tokens: Iterator[Emitted] | None = None
        self._cache: list[Any] = []
        self._last: Any = None  # mlx-lm's last response (its measured speeds)

    def __len__(self) -> int:
        return 0 if self._seq is None else 1

    @property
    def kv_bytes(self) -> int:
        return nbytes(self._cache) if self._seq is not None else 0

    @property
    def prefill_steps(self) -> int:
        seq = self._seq
        return int(seq is not None and seq.first_token_at is None)

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
        mx.reset_peak_memory()
        self._last = None
        n_t = cache_count(self.target.model)
        cache = start.cache[:n_t] if start.cache is not None else self.target.new_cache()
        self._seq = Sequence(
            tag, len(prompt), params, self.target.tokenizer.detokenizer, start.reused, on_text
        )
        self._cache = cache
        self._tokens = self._plain(job, cache, start.cached)

    def _plain(self, job: Prepared, cache: list[Any], cached: int) -> Iterator[Emitted]:
        params = job.params
        for r in stream_generate(
            self.target.model,
            self.target.tokenizer,
            mx.array(job.prompt[cached:]),
            max_tokens=params.max_tokens,
            sampler=sampler_for(params),
            logits_processors=logits_processors(params),
            prefill_step_size=PREFILL_STEP,
            prompt_cache=cache,
        ):
            self._last = r
            yield int(r.token), r.finish_reason, r.logprobs

    def step(self) -> Step:
        """The sequence's next token (the first step prefills its prompt too)."""
        seq, tokens = self._seq, self._tokens
        if seq is None or tokens is None:
            return Step(0, [], False)
        prefilling = seq.first_token_at is None
        item = next(tokens, None)
        finish = "length" if item is None else seq.advance(*item)
        if finish is None:
            return Step(1, [], prefilling)
        return Step(0 if item is None else 1, [(seq.tag, self._finish(finish))], prefilling)

    def _finish(self, reason: str) -> GenerationOutput | MlxqError:
        seq = self._seq
        assert seq is not None
        self.close()
        if self._last is None:
            raise RuntimeError("mlx-lm produced no tokens")
        return seq.finish(reason, self._last.prompt_tps, self._last.generation_tps)

    def remove(self, tag: Hashable) -> GenerationOutput | None:
        seq = self._seq
        if seq is None or seq.tag != tag:
            return None
        self.close()
        return seq.cut_short()

    def lengths(self) -> dict[Hashable, tuple[int, int]]:
        return {} if self._seq is None else {self._seq.tag: self._seq.length()}

    def first_token_at(self, tag: Hashable) -> float | None:
        seq = self._seq
        return seq.first_token_at if seq is not None and seq.tag == tag else None

    def close(self) -> None:
        if isinstance(self._tokens, Generator):
            self._tokens.close()
        self._seq, self._tokens, self._cache = None, None, []
