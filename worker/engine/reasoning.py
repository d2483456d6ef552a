"""Reasoning models: where a model's thinking ends and its answer begins.

The markers are what mlx-lm infers from the vocabulary (``TokenizerWrapper``'s
``think_start`` / ``think_end``: ``<think>`` ... ``</think>``, gpt-oss-style channels
and others), so every family mlx-lm knows is split. A chat template that opens the
thinking block in the prompt (Qwen3.5, QwQ, DeepSeek-R1 distills) leaves the model
*in* reasoning from its first token: its output is reasoning up to the end marker,
then the answer. A model that opens the block itself starts with the start marker.

A grammar (``response_format``, a forced tool call) applies to the answer: when the
prompt leaves the model in reasoning, the constraint waits for the end marker
(its ``trigger``). A model that would open the block itself is constrained from its
first token, so it answers without thinking.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from worker.engine.constrain import find_run


@dataclass(frozen=True)
class Thinking:
    """A model's reasoning markers (text and token ids)."""

    start: str
    end: str
    end_ids: tuple[int, ...]


def thinking_of(tokenizer: Any) -> Thinking | None:
    """The model's reasoning markers; None for a model mlx-lm knows none for."""
    if not getattr(tokenizer, "has_thinking", False):
        return None
    ids = tuple(int(t) for t in tokenizer.think_end_tokens or ())
    return Thinking(tokenizer.think_start, tokenizer.think_end, ids)


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
