"""ModernBERT encoders on MLX (answerdotai/ModernBERT, nomic-ai/modernbert-embed,
Alibaba-NLP/gte-modernbert, lightonai's and others' sentence embedders built on it).

Numerics follow Hugging Face's ``ModernBertModel``: token embeddings then a LayerNorm (no
positions table: rotary positions in every attention), pre-norm blocks (the first block's
attention takes its input as is), fused ``Wqkv``, a GLU MLP (``Wi`` gives input and gate,
``act(input) * gate``), no biases by default, a final LayerNorm. Every
``global_attn_every_n_layers``-th layer (from the first) attends globally with rotary base
``global_rope_theta``; the others attend within ``local_attention // 2`` positions either
side with base ``local_rope_theta``. Padded keys are masked out, as in ``worker.engine.encoder``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn

#: Hugging Face activation names this module runs (``hidden_activation``).
ACTIVATIONS = {
    "gelu": nn.gelu,
    "gelu_new": nn.gelu_approx,
    "gelu_pytorch_tanh": nn.gelu_approx,
    "silu": nn.silu,
}
_MASKED = -1e9


@dataclass(frozen=True)
class ModernBertConfig:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    max_position_embeddings: int = 8192
    norm_eps: float = 1e-5
    norm_bias: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    hidden_activation: str = "gelu"
    local_attention: int = 128
    global_attn_every_n_layers: int = 3
    global_rope_theta: float = 160_000.0
    local_rope_theta: float = 10_000.0

    @classmethod
    def of(cls, config: dict[str, Any]) -> ModernBertConfig:
        """From ``config.json`` as Hugging Face writes it (``global_rope_theta`` /
        ``local_rope_theta``, or ``rope_parameters`` per layer type in newer files)."""
        names = cls.__dataclass_fields__
        given = {k: v for k, v in config.items() if k in names and v is not None}
        rope = config.get("rope_parameters") or {}
        for kind, name in (("full_attention", "global"), ("sliding_attention", "local")):
            if isinstance(rope.get(kind), dict) and "rope_theta" in rope[kind]:
                given[f"{name}_rope_theta"] = rope[kind]["rope_theta"]
        c = cls(**given)
        if c.hidden_activation not in ACTIVATIONS:
            raise ValueError(f"ModernBERT hidden_activation {c.hidden_activation!r} is not run")
        return c

    def is_global(self, layer: int) -> bool:
        return layer % self.global_attn_every_n_layers == 0


class _Attention(nn.Module):
    def __init__(self, c: ModernBertConfig, theta: float) -> None:
        super().__init__()
        self.heads, self.theta = c.num_attention_heads, theta
        self.head_dim = c.hidden_size // c.num_attention_heads
        self.Wqkv = nn.Linear(c.hidden_size, 3 * c.hidden_size, bias=c.attention_bias)
        self.Wo = nn.Linear(c.hidden_size, c.hidden_size, bias=c.attention_bias)

    def _rope(self, x: mx.array) -> mx.array:  # (Hugging Face's rotate_half: not traditional)
        dims, base = self.head_dim, self.theta
        return mx.fast.rope(x, dims, traditional=False, base=base, scale=1.0, offset=0)

    def __call__(self, x: mx.array, bias: mx.array) -> mx.array:
        b, n, _ = x.shape
        qkv = self.Wqkv(x).reshape(b, n, 3, self.heads, self.head_dim).transpose(2, 0, 3, 1, 4)
        q, k, v = self._rope(qkv[0]), self._rope(qkv[1]), qkv[2]
        out = mx.fast.scaled_dot_product_attention(q, k, v, scale=self.head_dim**-0.5, mask=bias)
        return self.Wo(out.transpose(0, 2, 1, 3).reshape(b, n, -1))


class _MLP(nn.Module):
    def __init__(self, c: ModernBertConfig) -> None:
        super().__init__()
        self.Wi = nn.Linear(c.hidden_size, 2 * c.intermediate_size, bias=c.mlp_bias)
        self.Wo = nn.Linear(c.intermediate_size, c.hidden_size, bias=c.mlp_bias)
        self.act = ACTIVATIONS[c.hidden_activation]

    def __call__(self, x: mx.array) -> mx.array:
        given, gate = mx.split(self.Wi(x), 2, axis=-1)
        return self.Wo(self.act(given) * gate)


class _Layer(nn.Module):
    def __init__(self, c: ModernBertConfig, index: int) -> None:
        super().__init__()
        self.is_global = c.is_global(index)
        theta = c.global_rope_theta if self.is_global else c.local_rope_theta
        if index > 0:  # (the first block's attention takes the embeddings' norm as is)
            self.attn_norm = nn.LayerNorm(c.hidden_size, eps=c.norm_eps, bias=c.norm_bias)
        self.attn = _Attention(c, theta)
        self.mlp_norm = nn.LayerNorm(c.hidden_size, eps=c.norm_eps, bias=c.norm_bias)
        self.mlp = _MLP(c)

    def __call__(self, x: mx.array, bias: mx.array) -> mx.array:
        x = x + self.attn(self.attn_norm(x) if "attn_norm" in self else x, bias)
        return x + self.mlp(self.mlp_norm(x))


class _Embeddings(nn.Module):
    def __init__(self, c: ModernBertConfig) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(c.vocab_size, c.hidden_size)
        self.norm = nn.LayerNorm(c.hidden_size, eps=c.norm_eps, bias=c.norm_bias)


class ModernBertModel(nn.Module):
    """Token ids (padded, with a 0/1 mask) to the last hidden states."""

    def __init__(self, config: ModernBertConfig) -> None:
        super().__init__()
        self.config = config
        self.embeddings = _Embeddings(config)
        self.layers = [_Layer(config, i) for i in range(config.num_hidden_layers)]
        c = config
        self.final_norm = nn.LayerNorm(c.hidden_size, eps=c.norm_eps, bias=c.norm_bias)

    def __call__(self, ids: mx.array, mask: mx.array) -> mx.array:
        x = self.embeddings.norm(self.embeddings.tok_embeddings(ids))
        padded = ((1.0 - mask.astype(x.dtype)) * _MASKED).astype(x.dtype)[:, None, None, :]
        at = mx.arange(ids.shape[1])
        near = mx.abs(at[:, None] - at[None, :]) <= self.config.local_attention // 2
        local = padded + mx.where(near, 0.0, _MASKED).astype(x.dtype)
        for layer in self.layers:
            x = layer(x, padded if layer.is_global else local)
        return self.final_norm(x)
