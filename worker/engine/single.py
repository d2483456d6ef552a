"""One sequence alone: mlx-lm's own loop, plain or speculative, streamed or not.

Pure MLX and mlx-lm; knows nothing of Redis or jobs. Speculative decoding is
mlx-lm's own (``stream_generate`` with ``draft_model``): the draft proposes
``num_draft_tokens`` tokens per round and the target verifies them in one pass.
Each token goes through the one sequence type (``worker.engine.sequence``).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import stream_generate

from schemas import MlxqError
from worker.engine.output import GenerationOutput
from worker.engine.request import GenerationParams
from worker.engine.sampling import logits_processors, plain_sampler
from worker.engine.sequence import Deadline, OnText, Sequence


class _DraftCounter:
    """Counts draft tokens proposed and accepted from the stream of ``from_draft`` flags.

    mlx-lm's speculative loop drafts ``min(k, max_tokens - n)`` tokens per round,
    yields the accepted ones (``from_draft``), then one token of the target's
    own, which ends the round. So each round's proposal size is known exactly
    from where the round started. In the last round, draft tokens after a stop
    (EOS or stop string) were proposed but are not counted as accepted.
    """

    def __init__(self, seq: Sequence, k: int) -> None:
        self.seq, self.k = seq, k
        self.in_round = False
        self.proposed = self.accepted = 0  # this round's

    def add(self, from_draft: bool) -> None:
        seq = self.seq
        if not self.in_round:
            self.proposed = min(self.k, seq.params.max_tokens - (len(seq.tokens) - 1))
            self.accepted = 0
            seq.draft_proposed += self.proposed
            self.in_round = True
        if from_draft:
            seq.draft_accepted += 1
            self.accepted += 1
        else:
            seq.draft_rejections += self.accepted < self.proposed
            self.in_round = False


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
) -> GenerationOutput:
    """Generate a completion for ``prompt``; speculative when ``draft_model`` is given.

    Greedy output (temperature 0) is the same with or without a draft. ``on_text``
    receives the text as it is produced (see :class:`Sequence`). Past ``deadline``
    it raises :class:`JobTimeoutError` (checked at every token). ``cache`` (the
    target's layers, then the draft's) holds the KV state of the first ``cached``
    prompt tokens; only the rest is prefilled. ``reused``: what the output reports
    as cached.
    """
    if params.seed is not None:
        mx.random.seed(params.seed)
    kwargs: dict[str, object] = {
        "sampler": plain_sampler(params),
        "logits_processors": logits_processors(params),
    }
    if cache is not None:
        kwargs["prompt_cache"] = cache
    mx.reset_peak_memory()
    seq = Sequence(None, len(prompt), params, tokenizer.detokenizer, reused, on_text)
    counter = None
    if draft_model is not None:
        kwargs.update(draft_model=draft_model, num_draft_tokens=params.num_draft_tokens)
        counter = _DraftCounter(seq, params.num_draft_tokens)
    finish, last = "length", None
    for response in stream_generate(
        model, tokenizer, mx.array(prompt[cached:]), max_tokens=params.max_tokens, **kwargs
    ):
        last = response
        ended = seq.advance(int(response.token), response.finish_reason, response.logprobs)
        if counter is not None:
            counter.add(response.from_draft)
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
