"""EAGLE-3 heads: one decoder layer reading three of the target's layers.

An EAGLE-3 drafter (mlx-vlm's ``Eagle3DraftModel``, loaded by its ``load_drafter``) is
trained for one target: its first layer attends over (the next token's embedding, the
target's states at three layers, projected by ``fc``), its later steps feed its own
output state back. It reads the target's token embedding (its own copy is dropped).
The round and its bookkeeping are ``worker.engine.drafters``'.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask

from worker.engine.drafters import Head, target_layers

#: Drafter ``model_type``s of this kind mlxq runs (mlx-vlm's names).
RUNS = ("eagle3",)


def why_not(module: nn.Module, target: nn.Module, vocab: int) -> str | None:
    """Why ``module`` cannot draft for ``target`` (state size, vocabulary, layers read),
    or None."""
    cfg = module.config
    layers = target_layers(target)
    reads = list(cfg.capture_layer_ids)
    hidden = getattr(getattr(target, "args", None), "hidden_size", None)
    if hidden is not None and int(cfg.target_hidden_size) != int(hidden):
        return f"it reads states of size {cfg.target_hidden_size}, the target's are {hidden}"
    if int(cfg.transformer_layer_config.vocab_size) != vocab:
        return (
            f"its vocabulary has {cfg.transformer_layer_config.vocab_size} tokens, "
            f"the target's {vocab}"
        )
    if max(reads, default=0) >= layers:
        return f"it reads layers {reads}, the target has {layers}"
    return None


class Eagle3(Head):
    """An EAGLE-3 head bound to its target (whose embedding it shares)."""

    method = "eagle3"

    def __init__(self, module: nn.Module, target: nn.Module) -> None:
        self.reads = list(module.config.capture_layer_ids)
        super().__init__(module, target)
        inner = getattr(target, "model", target)
        embed = getattr(inner, "embed_tokens", None)
        weight = getattr(embed, "weight", None)
        if weight is not None and weight.shape == module.embed_tokens.weight.shape:
            module.embed_tokens = embed  # (its own copy is freed)
        #: The token embedding it reads: its target's (EAGLE-3 trains with it frozen).
        self.embed = module.embed_tokens
        self.hidden_size = int(module.config.transformer_layer_config.hidden_size)
        self.dtype = module.norm.weight.dtype

    def from_target(self, states: mx.array) -> mx.array:
        m = self.module
        return m.fc(m.input_norm(states) if m.input_norm is not None else states)

    def forward(self, tokens: mx.array, states: mx.array, caches: list[Any]) -> mx.array:
        m = self.module
        embeds = self.embed(tokens)
        position = caches[0].offset + 1  # (mlx-vlm's positions start at 1)
        h = states
        for i, (layer, c) in enumerate(zip(m.layers, caches, strict=True)):
            mask = create_attention_mask(h, c)
            h = layer(embeds, h, mask, c, position) if i == 0 else layer(h, mask, c, position)
        return h

    def logits(self, h: mx.array) -> mx.array:
        m = self.module
        h = m.norm(h)
        return self.embed.as_linear(h) if m.lm_head is None else m.lm_head(h)

    def predict(self, h: mx.array) -> mx.array:
        m = self.module
        ids = mx.argmax(self.logits(h), axis=-1).astype(mx.int32)
        if m.d2t is not None:
            ids = ids + m.d2t[ids]
        return ids.astype(mx.uint32)
