"""Reasoning models: where a model's thinking ends and its answer begins.

The markers are what mlx-lm infers from the vocabulary (``TokenizerWrapper``'s
``think_start`` / ``think_end``: ``<think>`` ... ``</think>``, gpt-oss-style channels
and others), so every family mlx-lm knows is split. A chat template that opens the
thinking block in the prompt (Qwen3.5, QwQ, DeepSeek-R1 distills) leaves the model
*in* reasoning from its first token: its output is reasoning up to the end marker,
then the answer. A model that opens the block itself starts with the start marker.

A thinking budget (``thinking_budget``, or ``reasoning_effort``'s) caps the block: past it
the end marker is forced (:class:`BudgetProcessor`), on every path a logits processor runs.

A grammar (``response_format``, a forced tool call) applies to the answer: when the
prompt leaves the model in reasoning, the constraint waits for the end marker
(its ``trigger``). A model that would open the block itself is constrained from its
first token, so it answers without thinking.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from worker.engine.constrain import find_run


@dataclass(frozen=True)
class Thinking:
    """A model's reasoning markers (text and token ids)."""

    start: str
    end: str
    end_ids: tuple[int, ...]
    start_ids: tuple[int, ...] = ()


def thinking_of(tokenizer: Any) -> Thinking | None:
    """The model's reasoning markers; None for a model mlx-lm knows none for."""
    if not getattr(tokenizer, "has_thinking", False):
        return None
    ids = tuple(int(t) for t in tokenizer.think_end_tokens or ())
    start = tuple(int(t) for t in tokenizer.think_start_tokens or ())
    return Thinking(tokenizer.think_start, tokenizer.think_end, ids, start)


def opens_in_reasoning(tokenizer: Any, prompt: list[int]) -> bool:
    """Whether the prompt leaves the model inside a thinking block (opened, not closed)."""
    if not getattr(tokenizer, "has_thinking", False):
        return False
    return int(tokenizer.rfind_think_start(prompt)) > int(tokenizer.rfind_think_end(prompt))


def reasoning_tokens(tokens: tuple[int, ...], thinking: Thinking, opened: bool) -> int:
    """How many of the completion's tokens are reasoning (through the end marker);
    ``opened``: the completion is in a thinking block (all of it, if never closed)."""
    if not thinking.end_ids:
        return 0
    at = find_run(tokens, thinking.end_ids)
    if at >= 0:
        return at + len(thinking.end_ids)
    return len(tokens) if opened else 0


@dataclass(frozen=True)
class Budget:
    """A cap on a sequence's thinking: at most ``tokens`` tokens inside the block, then
    the end marker is forced (the answer follows within ``max_tokens``)."""

    tokens: int
    start_ids: tuple[int, ...]
    end_ids: tuple[int, ...]
    in_reasoning: bool  # the prompt opened the block: the completion starts inside it

    def processor(self) -> BudgetProcessor:
        return BudgetProcessor(self)


def budget_of(tokenizer: Any, tokens: int | None, in_reasoning: bool) -> Budget | None:
    """The thinking budget of a request on this model; None without one, or for a model
    with no reasoning markers (it does not think)."""
    thinking = thinking_of(tokenizer)
    if tokens is None or thinking is None or not thinking.end_ids:
        return None
    return Budget(tokens, thinking.start_ids, thinking.end_ids, in_reasoning)


class BudgetProcessor:
    """An mlx-lm logits processor: once the thinking block holds the budget's tokens, only
    the end marker's next token is allowed, until the marker is written. It reads the
    history it is given at every call (what speculative rounds roll back is not counted)."""

    def __init__(self, budget: Budget) -> None:
        self.budget = budget
        self.offset: int | None = None  # tokens of the first call's history: all prompt

    def __call__(self, tokens: mx.array | None, logits: mx.array) -> mx.array:
        history = tokens.reshape(-1) if tokens is not None else mx.array([], mx.uint32)
        if self.offset is None:  # mlx-lm calls processors first before any token is sampled
            self.offset = history.size
        completion = history[self.offset :].tolist() if history.size > self.offset else []
        forced = self.forced(completion)
        if forced is None:
            return logits
        keep = mx.arange(logits.shape[-1]) == forced
        return mx.where(keep, logits, mx.array(-mx.inf, logits.dtype))

    def forced(self, completion: list[int]) -> int | None:
        """The token the next step must be (None: any), after ``completion``."""
        b = self.budget
        begin = 0
        if not b.in_reasoning:
            at = find_run(completion, b.start_ids) if b.start_ids else -1
            if at < 0:
                return None  # not thinking
            begin = at + len(b.start_ids)
        body = completion[begin:]
        if find_run(body, b.end_ids) >= 0 or len(body) < b.tokens:
            return None  # closed, or within the budget
        for k in range(len(b.end_ids) - 1, 0, -1):  # a marker of several tokens, begun
            if tuple(body[-k:]) == b.end_ids[:k]:
                return b.end_ids[k]
        return b.end_ids[0]
