"""A model's own multi-token-prediction heads: Qwen3.5's (and Qwen3.5-MoE's) MTP layers.

Qwen3.5 checkpoints carry ``mtp.*`` tensors that mlx-lm drops when it loads the
target; mlx-vlm's splitter loads them from the same checkpoint as a
``Qwen3_5MTPDraftModel`` (a job names ``"draft_model": "mtp"``). The head reads the
target's last state, normed as its output layer reads it, with the next token's
embedding (``fc`` over both, each normed), runs one full-attention decoder layer of
its own and predicts the token after it through the target's own output layer; its
later steps feed its own output state back. It holds no embedding or output layer of
its own (the target's are read). The round and its bookkeeping are
``worker.engine.drafters``'.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask

from worker.engine.drafters import Head, target_layers

#: Target ``model_type``s whose MTP heads mlxq runs.
RUNS = ("qwen3_5", "qwen3_5_moe")


def _text(config: dict[str, Any]) -> dict[str, Any]:
    return config.get("text_config") or config


def why_not_load(config: dict[str, Any]) -> str | None:
    """Why the checkpoint with ``config`` has no MTP head mlxq runs, or None."""
    kind = _text(config).get("model_type") or config.get("model_type")
    if kind not in RUNS:
        return f"model_type {kind!r}: mlxq runs the MTP heads of {', '.join(RUNS)}"
    if not int(_text(config).get("mtp_num_hidden_layers") or 0):
        return "its config declares no MTP layers (mtp_num_hidden_layers)"
    return None


def _inner(target: nn.Module) -> nn.Module:
    """The decoder stack of an mlx-lm target (embedding, layers, final norm)."""
    lm = getattr(target, "language_model", target)
    return getattr(lm, "model", lm)


def why_not(module: nn.Module, target: nn.Module) -> str | None:
    """Why ``module`` (an MTP head) cannot draft for ``target``, or None."""
    size = int(module.config.text_config.hidden_size)
    embed = getattr(_inner(target), "embed_tokens", None)
    if embed is None or int(embed.weight.shape[-1]) != size:
        return f"its states are {size} wide; the target's embedding is not"
    return None


class QwenMTP(Head):
    """A Qwen3.5 MTP head bound to its target: the target's embedding, final norm and
    output layer are read, not copied."""

    method = "mtp"

    def __init__(self, module: nn.Module, target: nn.Module) -> None:
        self.reads = [target_layers(target) - 1]
        super().__init__(module, target)
        inner = _inner(target)
        lm = getattr(target, "language_model", target)
        self.embed = inner.embed_tokens
        self.norm = inner.norm
        head = getattr(lm, "lm_head", None)
        self.output = head if head is not None else self.embed.as_linear
        self.hidden_size = int(module.config.text_config.hidden_size)
        self.dtype = module.norm.weight.dtype

    def from_target(self, states: mx.array) -> mx.array:
        return self.norm(states)  # (what the target's output layer reads)

    def forward(self, tokens: mx.array, states: mx.array, caches: list[Any]) -> mx.array:
        m = self.module
        embeds = self.embed(tokens)
        h = mx.concatenate([m.pre_fc_norm_embedding(embeds), m.pre_fc_norm_hidden(states)], axis=-1)
        h = m.fc(h)
        for layer, c in zip(m.layers, caches, strict=True):
            h = layer(h, mask=create_attention_mask(h, c), cache=c)
        return m.norm(h)

    def logits(self, h: mx.array) -> mx.array:
        return self.output(h)
