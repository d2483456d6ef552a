"""The batched engine: sequences on one model decode together (continuous batching).

Pure MLX and mlx-lm (``BatchGenerator``); knows nothing of Redis or jobs. Each
sequence has its own sampler, logits processors, stop strings and max_tokens;
sequences join between steps and leave as they finish. Which jobs may share a
batch, and taking them off the queue, is ``worker.continuous``'s business.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
from mlx_lm.generate import BatchGenerator
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p, make_sampler

from schemas import MlxqError
from worker.cache import LoadedModel
from worker.engine import (
    GenerationOutput,
    GenerationParams,
    StopScan,
    check_constraint,
    logits_processors,
)
from worker.logprobs import LogprobCollector


@functools.lru_cache(maxsize=64)
def _sampler(temperature: float, top_p: float, min_p: float, top_k: int) -> Any:
    # Sequences with the same settings share one sampler object, so BatchGenerator
    # samples the whole batch in one call instead of one call per sequence.
    return make_sampler(temperature, top_p, min_p, top_k=top_k)


class KeyedSampler:
    """mlx-lm's sampler chain (top-p, min-p, top-k, temperature) drawing from its own
    random key, split at every token: a seeded sequence samples the same tokens
    whatever else shares its batch or the global random state."""

    def __init__(
        self, temperature: float, top_p: float, min_p: float, top_k: int, seed: int
    ) -> None:
        self.temperature = temperature
        self.top_p, self.min_p, self.top_k = top_p, min_p, top_k
        self.key = mx.random.key(seed)

    def __call__(self, logprobs: mx.array) -> mx.array:
        if 0 < self.top_p < 1.0:
            logprobs = apply_top_p(logprobs, self.top_p)
        if self.min_p:
            logprobs = apply_min_p(logprobs, self.min_p)
        if self.top_k > 0:
            logprobs = apply_top_k(logprobs, self.top_k)
        self.key, key = mx.random.split(self.key)
        return mx.random.categorical(logprobs * (1.0 / self.temperature), key=key)


def sampler_for(params: GenerationParams) -> Any:
    """The sampler of one sequence: shared among sequences with the same settings
    (one call samples them all), or a :class:`KeyedSampler` of its own when seeded."""
    if params.seed is not None and params.temperature > 0:
        t, p, m, k = params.temperature, params.top_p, params.min_p, params.top_k
        return KeyedSampler(t, p, m, k, params.seed)
    return _sampler(params.temperature, params.top_p, params.min_p, params.top_k)


@dataclass
class SeqState:
    """One sequence of the batch, and what it has produced so far."""

    tag: Hashable
    prompt_len: int
    params: GenerationParams
    scan: StopScan
    detokenizer: Any
    cached_tokens: int = 0
    collector: LogprobCollector | None = None
    cut: bool = False  # a stop string cut the text
    admitted_at: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    text: str = ""
    tokens: list[int] = field(default_factory=list)
    draft_proposed: int = 0  # speculative batches (``worker.specbatch``)
    draft_accepted: int = 0

    def advance(self, token: int, finish_reason: str | None, logprobs: mx.array) -> str | None:
        """Add ``token`` to the text (and its logprobs); the finish reason if it ends here."""
        if finish_reason == "stop":  # EOS: not part of the text
            self.detokenizer.finalize()
            self.text += self.detokenizer.last_segment
            return "stop"
        grown_from = len(self.text)
        self.detokenizer.add_token(token)
        if finish_reason == "length":
            self.detokenizer.finalize()
        self.text += self.detokenizer.last_segment
        if self.collector is not None:
            self.collector.add(token, logprobs, len(self.text))
        if (at := self.scan.find(self.text, grown_from)) >= 0:
            self.text, self.cut = self.text[:at], True
            return "stop"
        return finish_reason

    def output(self, finish: str) -> GenerationOutput:
        end = time.perf_counter()
        first = self.first_token_at or end
        n = len(self.tokens)
        return GenerationOutput(
            text=self.text,
            finish_reason=finish,
            prompt_tokens=self.prompt_len,
            completion_tokens=n,
            time_to_first_token_s=first - self.admitted_at,
            prompt_tokens_per_s=self.prompt_len / max(first - self.admitted_at, 1e-9),
            generation_tokens_per_s=n / max(end - first, 1e-9) if n > 1 else 0.0,
            total_time_s=end - self.admitted_at,
            draft_tokens_proposed=self.draft_proposed,
            draft_tokens_accepted=self.draft_accepted,
            peak_memory_gb=mx.get_peak_memory() / 1e9,
            token_ids=tuple(self.tokens),
            cached_tokens=self.cached_tokens,
            logprobs=self.collector.kept(len(self.text), self.cut) if self.collector else None,
        )


#: Prompt tokens per sequence prefilled between two decoding steps: a long prompt
#: joining a running batch is prefilled in chunks while the others keep decoding.
PREFILL_STEP = 512
#: Sequences prefilled together (their chunks are one forward pass).
PREFILL_BATCH = 8


@dataclass
class Step:
    """What one decoding step did."""

    tokens: int  # tokens decoded (one per decoding sequence; more when speculative)
    # sequences that finished, with their outputs (or what failed them)
    done: list[tuple[Hashable, GenerationOutput | MlxqError]]
    prefilled: bool  # whether prompt chunks were prefilled in this step too
    decoding: int = -1  # sequences that decoded (-1: as many as ``tokens``)

    @property
    def sequences(self) -> int:
        return self.tokens if self.decoding < 0 else self.decoding


class BatchEngine:
    """A continuous batch on one loaded model: :meth:`add` sequences, :meth:`step` them.

    The engine takes every sequence it is given (up to ``max_batch``); how many
    to give it is the caller's decision (``worker.continuous``).
    """

    def __init__(
        self, target: LoadedModel, max_batch: int, prefill_step: int = PREFILL_STEP
    ) -> None:
        self.target = target
        tok = target.tokenizer
        self.gen = BatchGenerator(
            target.model,
            stop_tokens=[[t] for t in tok.eos_token_ids],
            completion_batch_size=max_batch,
            prefill_batch_size=min(max_batch, PREFILL_BATCH),
            prefill_step_size=prefill_step,
        )
        self._seqs: dict[int, SeqState] = {}

    @property
    def kv_bytes(self) -> int:
        """Bytes the batch's KV caches hold now (sequences decoding and prefilling)."""
        return self.gen.prompt_cache_nbytes

    def __len__(self) -> int:
        return len(self._seqs)

    def add(
        self,
        tag: Hashable,
        prompt: list[int],
        params: GenerationParams,
        cache: list[Any] | None = None,
        cached: int = 0,
        reused: int = 0,
    ) -> None:
        """Start decoding ``prompt`` (it joins at the next step); ``tag`` names it in outputs.

        ``cache`` holds the KV state of the first ``cached`` prompt tokens (a kept
        prefix): only the rest is prefilled, and the penalties still see the whole
        prompt. ``reused`` is what the output reports as cached.
        """
        sampler = sampler_for(params)
        (uid,) = self.gen.insert(
            [prompt[cached:]],
            [params.max_tokens],
            caches=[cache] if cache is not None else None,
            all_tokens=[prompt[:cached]] if cache is not None else None,
            samplers=[sampler],
            logits_processors=[logits_processors(params)],
        )
        detok = self.target.tokenizer.detokenizer  # a fresh one per access
        scan = StopScan(params.stop)
        collector = LogprobCollector(params.logprobs) if params.logprobs is not None else None
        self._seqs[uid] = SeqState(tag, len(prompt), params, scan, detok, reused, collector)

    def lengths(self) -> list[tuple[int, int]]:
        """(tokens in its KV cache, tokens it may still add) of every sequence: what
        ``worker.memory.batch_peak_bytes`` projects from."""
        seqs = self._seqs.values()
        return [(s.prompt_len + len(s.tokens), s.params.max_tokens - len(s.tokens)) for s in seqs]

    def first_token_at(self, tag: Hashable) -> float | None:
        """When the running sequence ``tag`` produced its first token (perf_counter)."""
        return next((s.first_token_at for s in self._seqs.values() if s.tag == tag), None)

    def drop(self, tag: Hashable) -> None:
        """Stop decoding the sequence ``tag`` (no output for it)."""
        for uid, seq in list(self._seqs.items()):
            if seq.tag == tag:
                self.gen.remove([uid])
                del self._seqs[uid]

    def step(self) -> Step:
        """One decoding step (and a chunk of prefill for sequences joining)."""
        prompts, responses = self.gen.next()
        now = time.perf_counter()
        done: list[tuple[Hashable, GenerationOutput | MlxqError]] = []
        for r in responses:
            seq = self._seqs.get(r.uid)
            if seq is None:
                continue
            if seq.first_token_at is None:
                seq.first_token_at = now
            seq.tokens.append(int(r.token))
            finish = seq.advance(int(r.token), r.finish_reason, r.logprobs)
            if finish is not None:
                if finish == "stop" and r.finish_reason is None:
                    self.gen.remove([r.uid])  # a stop string: the generator would go on
                del self._seqs[r.uid]
                try:
                    check_constraint(seq.params, seq.tokens, finish)
                except MlxqError as e:  # this sequence fails, not the batch
                    done.append((seq.tag, e))
                    continue
                done.append((seq.tag, seq.output(finish)))
        return Step(len(responses), done, bool(prompts))

    def close(self) -> None:
        self.gen.close()
