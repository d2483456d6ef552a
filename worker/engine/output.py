"""What a finished generation produced and what it cost: every engine's one output type."""

from __future__ import annotations

from dataclasses import dataclass

from worker.engine.logprobs import LogprobEntry


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
    draft_rejections: int = 0  # speculative rounds that stopped before their last proposal
    idle_rounds: int = 0  # speculative rounds that proposed nothing (a lookup's miss)
    gave_up_after: int = 0  # > 0: tokens speculated before it measured slower than plain
    speculated_s: float = 0.0  # seconds of those (or of all speculative rounds)
    cached_tokens: int = 0  # prompt tokens taken from the prefix cache, not prefilled
    logprobs: tuple[LogprobEntry, ...] | None = None  # per token of the text, if asked
    in_reasoning: bool = False  # the prompt left the model inside a thinking block
    stop_sequence: str | None = None  # the stop string that ended the text, if one did
    # n > 1: choices 1..n-1 (this one is choice 0; completion_tokens counts them all)
    others: tuple[GenerationOutput, ...] = ()

    @property
    def acceptance_rate(self) -> float | None:
        if not self.draft_tokens_proposed:
            return None
        return self.draft_tokens_accepted / self.draft_tokens_proposed

    @property
    def decode_s(self) -> float:
        """Seconds spent after the first token (decoding, not prefill)."""
        return self.total_time_s - self.time_to_first_token_s
