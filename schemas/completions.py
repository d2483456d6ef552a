"""Legacy ``/v1/completions`` as a translation of chat jobs: the prompt runs as a chat
job's one user message with ``raw_prompt`` (tokenized as is, no chat template), and
the chat.completion comes back as a ``text_completion``."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

#: Legacy fields mlxq does not implement; set to anything but off, they are refused.
UNSUPPORTED = {
    "echo": "echo is not supported",
    "suffix": "suffix (insertion) is not supported",
    "logprobs": "legacy logprobs are not supported: use chat completions' logprobs",
}


class CompletionRequest(BaseModel):
    """A ``POST /v1/completions`` body (one prompt string)."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1, max_length=512)
    prompt: str | list[str] = Field(min_length=1)
    max_tokens: int | None = Field(default=16, ge=1)  # OpenAI's default for this endpoint
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    n: int = Field(default=1, ge=1)
    best_of: int | None = Field(default=None, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    user: str | None = None
    echo: bool = False
    suffix: str | None = None
    logprobs: int | None = None
    draft_model: str | None = None  # mlxq, as on chat
    num_draft_tokens: int | None = None
    time_limit_s: float | None = Field(default=None, gt=0)  # mlxq: as on chat

    def refused(self) -> str | None:
        for name, why in UNSUPPORTED.items():
            if getattr(self, name) not in (None, False, 0):
                return f"{name}: {why}"
        if self.best_of not in (None, self.n):
            return "best_of: only best_of equal to n (or unset) is supported"
        if isinstance(self.prompt, list) and len(self.prompt) != 1:
            return "prompt: give one prompt per request (a list of one string at most)"
        return None

    def to_chat(self) -> dict[str, Any]:
        prompt = self.prompt if isinstance(self.prompt, str) else self.prompt[0]
        body = self.model_dump(
            exclude={"prompt", "best_of", "echo", "suffix", "logprobs"}, exclude_none=True
        )
        return body | {"messages": [{"role": "user", "content": prompt}], "raw_prompt": True}


_USAGE = ("prompt_tokens", "completion_tokens", "total_tokens")


def from_chat(completion: dict[str, Any]) -> dict[str, Any]:
    """The ``text_completion`` for the job's chat.completion."""
    return {
        "id": completion["id"].replace("chatcmpl-", "cmpl-", 1),
        "object": "text_completion",
        "created": completion["created"],
        "model": completion["model"],
        "choices": [
            {
                "text": c["message"].get("content") or "",
                "index": c["index"],
                "logprobs": None,
                "finish_reason": c["finish_reason"],
            }
            for c in completion["choices"]
        ],
        "usage": {k: completion["usage"][k] for k in _USAGE},
        "system_fingerprint": completion.get("system_fingerprint"),
    }


def chunk_from_chat(chunk: dict[str, Any]) -> dict[str, Any]:
    """A streamed ``text_completion`` chunk for a chat.completion.chunk."""
    out = {
        "id": chunk["id"].replace("chatcmpl-", "cmpl-", 1),
        "object": "text_completion",
        "created": chunk["created"],
        "model": chunk["model"],
        "choices": [
            {
                "text": (c.get("delta") or {}).get("content") or "",
                "index": c["index"],
                "logprobs": None,
                "finish_reason": c.get("finish_reason"),
            }
            for c in chunk.get("choices") or []
        ],
    }
    if chunk.get("usage"):
        out["usage"] = chunk["usage"]
    return out
