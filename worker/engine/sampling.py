"""How a sequence picks its next token: its logits processors and its sampler."""

from __future__ import annotations

import functools
from typing import Any

import mlx.core as mx
from mlx_lm.sample_utils import (
    apply_min_p,
    apply_top_k,
    apply_top_p,
    apply_xtc,
    make_logits_processors,
    make_sampler,
)

from worker.engine.request import GenerationParams


def logits_processors(params: GenerationParams) -> list:
    """One sequence's processors: bias and penalties, the thinking budget, the grammar's
    mask (nothing after it lifts a token the grammar forbids), then ``min_tokens``. Fresh
    objects: the mask is stateful."""
    processors = make_logits_processors(
        logit_bias=dict(params.logit_bias) or None,
        repetition_penalty=params.repetition_penalty if params.repetition_penalty != 1.0 else None,
        repetition_context_size=params.repetition_context_size,
        presence_penalty=params.presence_penalty or None,
        presence_context_size=params.max_tokens,
        frequency_penalty=params.frequency_penalty or None,
        frequency_context_size=params.max_tokens,
    )
    if params.budget is not None:  # (before the grammar, which waits for the answer)
        processors.append(params.budget.processor())
    if params.constraint is not None:
        processors.append(params.constraint.processor())
    if params.min_tokens and params.eos:  # (last: it only lowers, and sees the mask)
        processors.append(MinTokens(params.min_tokens, params.eos))
    return processors


class MinTokens:
    """An mlx-lm logits processor: the end tokens are banned until the completion holds
    ``n`` tokens (``min_tokens``), unless nothing else is allowed (a grammar that is
    complete ends the output). It reads the history it is given at every call."""

    def __init__(self, n: int, eos: tuple[int, ...]) -> None:
        self.n, self.eos = n, mx.array(eos)
        self.offset: int | None = None  # tokens of the first call's history: all prompt

    def __call__(self, tokens: mx.array | None, logits: mx.array) -> mx.array:
        size = tokens.size if tokens is not None else 0
        if self.offset is None:  # mlx-lm calls processors first before any token is sampled
            self.offset = size
        if size - self.offset >= self.n:
            return logits
        banned = (mx.arange(logits.shape[-1])[:, None] == self.eos[None, :]).any(axis=1)
        floored = mx.where(banned, mx.array(-mx.inf, logits.dtype), logits)
        others = (floored > -mx.inf).any(axis=-1, keepdims=True)  # anything but the end left
        return mx.where(others, floored, logits)


#: A sampler's settings: temperature, top_p, min_p, top_k, and XTC's probability,
#: threshold and the tokens it never excludes.
Settings = tuple[float, float, float, int, float, float, tuple[int, ...]]


def settings_of(params: GenerationParams) -> Settings:
    p = params
    xtc = (p.xtc_probability, p.xtc_threshold, p.xtc_special)
    return (p.temperature, p.top_p, p.min_p, p.top_k, *xtc)


@functools.lru_cache(maxsize=64)
def _sampler(settings: Settings) -> Any:
    # Sequences with the same settings share one sampler object, so BatchGenerator
    # samples the whole batch in one call instead of one call per sequence.
    return _make(settings)


def _make(settings: Settings) -> Any:
    t, top_p, min_p, top_k, xtc_p, xtc_t, special = settings
    return make_sampler(
        t,
        top_p,
        min_p,
        top_k=top_k,
        xtc_probability=xtc_p,
        xtc_threshold=xtc_t,
        xtc_special_tokens=list(special),
    )


class KeyedSampler:
    """mlx-lm's sampler chain (top-p, min-p, top-k, temperature) drawing from its own
    random key, split at every token: a seeded sequence samples the same tokens
    whatever else shares its batch or the global random state."""

    def __init__(self, settings: Settings, seed: int) -> None:
        self.temperature, self.top_p, self.min_p, self.top_k = settings[:4]
        self.xtc_probability, self.xtc_threshold, self.xtc_special = settings[4:]
        self.key = mx.random.key(seed)

    def __call__(self, logprobs: mx.array) -> mx.array:
        if 0 < self.top_p < 1.0:
            logprobs = apply_top_p(logprobs, self.top_p)
        if self.min_p:
            logprobs = apply_min_p(logprobs, self.min_p)
        self.key, key = mx.random.split(self.key)
        if self.xtc_probability > 0:  # (mlx-lm's apply_xtc, its coin from this key)
            self.key, coin = mx.random.split(self.key)
            logprobs = self._xtc(logprobs, mx.random.uniform(key=coin))
        if self.top_k > 0:
            logprobs = apply_top_k(logprobs, self.top_k)
        return mx.random.categorical(logprobs * (1.0 / self.temperature), key=key)

    def _xtc(self, logprobs: mx.array, coin: mx.array) -> mx.array:
        # mlx-lm's own exclusion, always applied (probability 1: its global coin never
        # wins), then kept or not by this sequence's coin
        special = list(self.xtc_special)
        excluded = apply_xtc(logprobs, 1.0, self.xtc_threshold, special)
        return mx.where(coin > self.xtc_probability, logprobs, excluded)


def sampler_for(params: GenerationParams) -> Any:
    """The sampler of one sequence, alone or in a batch: shared among sequences with the
    same settings (one call samples a batch's), or a :class:`KeyedSampler` of its own
    when seeded (the same draws alone or among others)."""
    if params.seed is not None and params.temperature > 0:
        return KeyedSampler(settings_of(params), params.seed)
    return _sampler(settings_of(params))


def pick(
    logits: mx.array, context: list[int] | mx.array, processors: list[Any], sampler: Any
) -> tuple[mx.array, mx.array]:
    """A token from ``logits`` after ``processors`` (seeing ``context``: prompt and tokens
    so far), and the log-probability vector it was sampled from: what the speculative
    paths, alone and batched, sample every position with."""
    if processors:
        ctx = context if isinstance(context, mx.array) else mx.array(context, mx.uint32)
        for p in processors:
            logits = p(ctx, logits)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    return sampler(logprobs), logprobs
