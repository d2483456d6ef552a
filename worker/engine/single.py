"""One sequence alone, plain or speculative, streamed or not.

Pure MLX and mlx-lm; knows nothing of Redis or jobs. Plain decoding is mlx-lm's
own loop (``stream_generate``); speculative decoding is mlxq's
(:mod:`worker.engine.speculate`), with a draft model or prompt lookup
(:mod:`worker.engine.lookup`), exact on every cache type where mlx-lm's is exact
on plain KV caches only. Each token goes through the one
sequence type (``worker.engine.sequence``).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import stream_generate
from mlx_lm.models.cache import make_prompt_cache

from schemas import MlxqError
from worker.engine.layers import count as cache_count
from worker.engine.lookup import Lookup, NgramIndex
from worker.engine.output import GenerationOutput
from worker.engine.prefill import PREFILL_STEP
from worker.engine.request import GenerationParams
from worker.engine.sampling import logits_processors, plain_sampler
from worker.engine.sequence import Deadline, OnText, Sequence
from worker.engine.speculate import (
    DraftProposer,
    GiveUp,
    LookupProposer,
    Proposer,
    Tally,
    speculative_tokens,
)


def generate(
    model: nn.Module,
    tokenizer: Any,
    prompt: list[int],
    params: GenerationParams,
    draft_model: nn.Module | None = None,
    on_text: OnText | None = None,
    deadline: Deadline | None = None,
    cache: list[Any] | None = None,
    cached: int = 0,
    reused: int = 0,
    lookup: Lookup | None = None,
    give_up_below: float | None = None,
) -> GenerationOutput:
    """Generate a completion for ``prompt``; speculative when ``draft_model`` is given
    (proposing ``params.num_draft_tokens`` per round), or with prompt ``lookup`` (its
    proposals capped the same way).

    Greedy output (temperature 0) is the same with or without speculation. With
    ``give_up_below`` (tokens/s), speculation stops for the rest of the job once it
    measures slower than that (:class:`~worker.engine.speculate.GiveUp`). ``on_text``
    receives the text as it is produced (see :class:`Sequence`). Past ``deadline``
    it raises :class:`JobTimeoutError` (checked at every token). ``cache`` (the
    target's layers, then the draft's) holds the KV state of the first ``cached``
    prompt tokens; only the rest is prefilled. ``reused``: what the output reports
    as cached.
    """
    if params.seed is not None:
        mx.random.seed(params.seed)
    mx.reset_peak_memory()
    seq = Sequence(None, len(prompt), params, tokenizer.detokenizer, reused, on_text)
    if draft_model is not None or lookup is not None:
        eos = frozenset(int(t) for t in tokenizer.eos_token_ids)
        n_t = cache_count(model)
        if cache is None:
            t_cache, cached = make_prompt_cache(model), 0
        else:
            t_cache = cache[:n_t]
        proposer: Proposer
        if draft_model is not None:
            d_cache = cache[n_t:] if cache is not None else make_prompt_cache(draft_model)
            proposer = DraftProposer(draft_model, d_cache, prompt, cached)
        else:
            assert lookup is not None
            proposer = LookupProposer(NgramIndex(lookup, prompt))
        finish = _speculative(
            model, proposer, prompt, seq, eos, deadline, t_cache, cached, give_up_below
        )
        out = seq.finish(finish)
    else:
        finish, last = "length", None
        kwargs: dict[str, object] = {
            "sampler": plain_sampler(params),
            "logits_processors": logits_processors(params),
            "prefill_step_size": PREFILL_STEP,
        }
        if cache is not None:
            kwargs["prompt_cache"] = cache
        for response in stream_generate(
            model, tokenizer, mx.array(prompt[cached:]), max_tokens=params.max_tokens, **kwargs
        ):
            last = response
            ended = seq.advance(int(response.token), response.finish_reason, response.logprobs)
            if ended is not None:
                finish = ended
                break
            if deadline is not None:
                deadline.check()
        if last is None:
            raise RuntimeError("mlx-lm produced no tokens")
        out = seq.finish(finish, last.prompt_tps, last.generation_tps)
    if isinstance(out, MlxqError):
        raise out
    return out


def _speculative(
    model: nn.Module,
    proposer: Proposer,
    prompt: list[int],
    seq: Sequence,
    eos: frozenset[int],
    deadline: Deadline | None,
    t_cache: list[Any],
    cached: int,
    give_up_below: float | None = None,
) -> str:
    """Decode ``seq`` speculatively to its end; its finish reason."""
    params = seq.params
    tally = Tally()
    if give_up_below is not None:
        proposer = GiveUp(proposer, tally, give_up_below)
    tokens = speculative_tokens(
        model,
        proposer,
        prompt,
        k=params.num_draft_tokens,
        max_tokens=params.max_tokens,
        sampler=plain_sampler(params),
        processors=logits_processors(params),
        target_cache=t_cache,
        cached=cached,
        tally=tally,
    )
    finish = "length"
    for t in tokens:
        ended = seq.emit(t.token, eos, t.logprobs)
        seq.draft_proposed, seq.draft_accepted = tally.proposed, tally.accepted
        seq.draft_rejections, seq.idle_rounds = tally.rejections, tally.idle
        seq.gave_up = tally.gave_up
        if ended is not None:
            finish = ended
            break
        if deadline is not None:
            deadline.check()
    tokens.close()
    seq.speculated = (tally.spec_tokens, tally.spec_s)
    return finish
