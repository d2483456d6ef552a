"""The generation engine: chat template, sampling, stop strings, plain or speculative decoding.

Pure MLX and mlx-lm; knows nothing of Redis or jobs. Speculative decoding is
mlx-lm's own (``stream_generate`` with ``draft_model``): the draft proposes
``num_draft_tokens`` tokens per round and the target verifies them in one pass.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import stream_generate
from mlx_lm.sample_utils import make_logits_processors, make_sampler

from schemas import ChatRequest, ContextLengthError, InvalidRequestError, JobTimeoutError
from worker.constrain import Constraint, verify
from worker.logprobs import LogprobCollector, LogprobEntry
from worker.prefix import common_prefix

#: Completion limit when a request sets neither max_tokens nor max_completion_tokens.
DEFAULT_MAX_TOKENS = 512


@dataclass(frozen=True)
class GenerationParams:
    """Everything that shapes one generation, resolved from a request."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    stop: tuple[str, ...] = ()
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    num_draft_tokens: int = 3
    constraint: Constraint | None = None  # response_format: the grammar the output follows
    logprobs: int | None = None  # None: no logprobs; else how many top alternatives (0-20)

    @property
    def penalty_window(self) -> int:
        """Trailing tokens (prompt and completion) the penalties look at; 0 without any."""
        return self.max_tokens if (self.presence_penalty or self.frequency_penalty) else 0


@dataclass(frozen=True)
class GenerationOutput:
    """The text and what it cost."""

    text: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    time_to_first_token_s: float
    prompt_tokens_per_s: float
    generation_tokens_per_s: float
    total_time_s: float
    draft_tokens_proposed: int
    draft_tokens_accepted: int
    peak_memory_gb: float
    token_ids: tuple[int, ...]
    cached_tokens: int = 0  # prompt tokens taken from the prefix cache, not prefilled
    logprobs: tuple[LogprobEntry, ...] | None = None  # per token of the text, if asked
    # n > 1: choices 1..n-1 (this one is choice 0; completion_tokens counts them all)
    others: tuple[GenerationOutput, ...] = ()

    @property
    def acceptance_rate(self) -> float | None:
        if not self.draft_tokens_proposed:
            return None
        return self.draft_tokens_accepted / self.draft_tokens_proposed


def _render(tokenizer: object, messages: list[dict[str, str]], prompt: bool) -> list[int]:
    """``messages`` through the model's chat template (a plain "role: content" transcript
    without one) as token ids; ``prompt`` adds the assistant's turn to generate."""
    if not getattr(tokenizer, "has_chat_template", False):
        text = "\n".join(f"{m['role']}: {m['content']}" for m in messages)
        return list(tokenizer.encode(text + "\nassistant:" if prompt else text))  # type: ignore[attr-defined]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=prompt)  # type: ignore[attr-defined]
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return [int(i) for i in ids]


def prompt_tokens(tokenizer: object, request: ChatRequest) -> list[int]:
    """The request's messages through the model's chat template, as token ids."""
    return _render(tokenizer, [m.as_template_dict() for m in request.messages], prompt=True)


def message_boundary(tokenizer: object, request: ChatRequest, prompt: list[int]) -> int:
    """How many leading tokens of ``prompt`` render every message but the last: the part
    batch jobs share (a system prompt, few-shot turns). 0 for a single message.

    Tokens, not text: it is the common prefix of the two token sequences, so a chat
    template or tokenizer that renders the shorter conversation differently at its end
    only shortens it.
    """
    if len(request.messages) < 2:
        return 0
    head = [m.as_template_dict() for m in request.messages[:-1]]
    try:
        ids = _render(tokenizer, head, prompt=False)
    except Exception:  # a template that refuses a conversation without a user turn
        return 0
    return min(common_prefix(ids, prompt), len(prompt) - 1)


def params_for(
    request: ChatRequest,
    n_prompt: int,
    context_length: int | None,
    vocab_size: int,
    default_num_draft_tokens: int = 3,
    constraint: Constraint | None = None,
) -> GenerationParams:
    """Resolve a request's sampling fields and limits against the model; raise on misfit.
    ``constraint``: the request's response_format compiled for the model's tokenizer."""
    limit = request.token_limit
    if context_length is not None:
        room = context_length - n_prompt
        if room < 1 or (limit is not None and limit > room):
            raise ContextLengthError(
                f"this model's maximum context length is {context_length} tokens; the prompt "
                f"has {n_prompt} tokens and {limit or 1} completion tokens were requested"
            )
        max_tokens = limit or min(DEFAULT_MAX_TOKENS, room)
    else:
        max_tokens = limit or DEFAULT_MAX_TOKENS
    bias = tuple(sorted((request.logit_bias or {}).items()))
    bad = [t for t, _ in bias if not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequestError(f"logit_bias: token ids {bad} are outside the vocabulary")
    return GenerationParams(
        max_tokens=max_tokens,
        temperature=request.temperature,
        top_p=request.top_p,
        top_k=request.top_k,
        min_p=request.min_p,
        stop=tuple(request.stop or ()),
        seed=request.seed,
        presence_penalty=request.presence_penalty,
        frequency_penalty=request.frequency_penalty,
        logit_bias=bias,
        num_draft_tokens=request.num_draft_tokens or default_num_draft_tokens,
        constraint=constraint,
        logprobs=(request.top_logprobs or 0) if request.logprobs else None,
    )


def logits_processors(params: GenerationParams) -> list:
    """One sequence's processors: bias and penalties, then the grammar's mask last (so
    nothing can lift a token the grammar forbids). Fresh objects: the mask is stateful."""
    processors = make_logits_processors(
        logit_bias=dict(params.logit_bias) or None,
        presence_penalty=params.presence_penalty or None,
        presence_context_size=params.max_tokens,
        frequency_penalty=params.frequency_penalty or None,
        frequency_context_size=params.max_tokens,
    )
    if params.constraint is not None:
        processors.append(params.constraint.processor())
    return processors


def check_constraint(params: GenerationParams, tokens: Sequence[int], finish: str) -> None:
    """Raise unless ``tokens`` follow the job's grammar (a no-op without one)."""
    if params.constraint is not None:
        verify(params.constraint, tokens, finish)


class StopScan:
    """Finds stop strings in text that grows at its end (one scan per new piece)."""

    def __init__(self, stops: Sequence[str]) -> None:
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

    def safe(self, text: str) -> int:
        """How much of ``text`` can be shown: what follows could still begin a stop string."""
        return len(text) - max(self.longest - 1, 0)


@dataclass(frozen=True)
class Deadline:
    """When a job must be done (a ``time.perf_counter()`` value) and its timeout."""

    at: float
    timeout_s: float

    @property
    def passed(self) -> bool:
        return time.perf_counter() >= self.at

    def error(self) -> JobTimeoutError:
        return JobTimeoutError(f"job timed out after {self.timeout_s:g}s")

    def check(self) -> None:
        """Raise :class:`JobTimeoutError` once the deadline has passed."""
        if self.passed:
            raise self.error()


class _DraftCounter:
    """Counts draft tokens proposed and accepted from the stream of ``from_draft`` flags.

    mlx-lm's speculative loop drafts ``min(k, max_tokens - n)`` tokens per round,
    yields the accepted ones (``from_draft``), then one token of the target's
    own, which ends the round. So each round's proposal size is known exactly
    from where the round started. In the last round, draft tokens after a stop
    (EOS or stop string) were proposed but are not counted as accepted.
    """

    def __init__(self, k: int, max_tokens: int) -> None:
        self.k, self.max_tokens = k, max_tokens
        self.proposed = self.accepted = self.n = 0
        self.in_round = False

    def add(self, from_draft: bool) -> None:
        if not self.in_round:
            self.proposed += min(self.k, self.max_tokens - self.n)
            self.in_round = True
        self.n += 1
        if from_draft:
            self.accepted += 1
        else:
            self.in_round = False


def generate(
    model: nn.Module,
    tokenizer: object,
    prompt: list[int],
    params: GenerationParams,
    draft_model: nn.Module | None = None,
    on_text: Callable[[str, Sequence[LogprobEntry]], None] | None = None,
    deadline: Deadline | None = None,
    cache: list[Any] | None = None,
    cached: int = 0,
) -> GenerationOutput:
    """Generate a completion for ``prompt``; speculative when ``draft_model`` is given.

    Greedy output (temperature 0) is the same with or without a draft.
    ``on_text`` receives the text as it is produced, in pieces that concatenate
    to exactly the final text: text that could still turn out to be the start
    of a stop string is held back until it cannot. With logprobs asked for, each
    piece comes with the entries of the tokens whose text it completes. Past
    ``deadline`` it raises :class:`JobTimeoutError` (checked at every token).
    ``cache`` (the target's layers, then the draft's) holds the KV state of the first
    ``cached`` prompt tokens; only the rest is prefilled.
    """
    if params.seed is not None:
        mx.random.seed(params.seed)
    kwargs: dict[str, object] = {
        "sampler": make_sampler(params.temperature, params.top_p, params.min_p, top_k=params.top_k),
        "logits_processors": logits_processors(params),
    }
    counter = None
    if draft_model is not None:
        kwargs.update(draft_model=draft_model, num_draft_tokens=params.num_draft_tokens)
        counter = _DraftCounter(params.num_draft_tokens, params.max_tokens)
    mx.reset_peak_memory()
    start = time.perf_counter()
    first_token_at = None
    text, finish, tokens = "", "length", []
    last = None
    scan = StopScan(params.stop)
    emitted = sent = 0
    collector = LogprobCollector(params.logprobs) if params.logprobs is not None else None
    cut = False
    if cache is not None:
        kwargs["prompt_cache"] = cache
    for response in stream_generate(
        model, tokenizer, mx.array(prompt[cached:]), max_tokens=params.max_tokens, **kwargs
    ):
        if first_token_at is None:
            first_token_at = time.perf_counter()
        last = response
        tokens.append(int(response.token))
        if counter is not None:
            counter.add(response.from_draft)
        grown_from = len(text)
        text += response.text
        if collector is not None and response.finish_reason != "stop":  # not EOS
            collector.add(int(response.token), response.logprobs, len(text))
        if (at := scan.find(text, grown_from)) >= 0:
            text, finish, cut = text[:at], "stop", True
            break
        if response.finish_reason is not None:
            finish = response.finish_reason
        if on_text is not None and (safe := scan.safe(text)) > emitted:
            done = collector.covered(safe, sent) if collector is not None else 0
            on_text(text[emitted:safe], collector.entries[sent:done] if collector else ())
            emitted, sent = safe, max(sent, done)
        if deadline is not None:
            deadline.check()
    kept = collector.kept(len(text), cut) if collector is not None else None
    if on_text is not None and (len(text) > emitted or (kept and len(kept) > sent)):
        on_text(text[emitted:], kept[sent:] if kept else ())
    end = time.perf_counter()
    if last is None:
        raise RuntimeError("mlx-lm produced no tokens")
    check_constraint(params, tokens, finish)
    return GenerationOutput(
        text=text,
        finish_reason=finish,
        prompt_tokens=len(prompt),
        completion_tokens=len(tokens),
        time_to_first_token_s=(first_token_at or end) - start,
        prompt_tokens_per_s=last.prompt_tps,
        generation_tokens_per_s=last.generation_tps,
        total_time_s=end - start,
        draft_tokens_proposed=counter.proposed if counter else 0,
        draft_tokens_accepted=counter.accepted if counter else 0,
        peak_memory_gb=mx.get_peak_memory() / 1e9,
        token_ids=tuple(tokens),
        logprobs=kept,
    )
