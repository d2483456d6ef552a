"""Encoder embedding models (the BERT family) on MLX, loaded from a sentence-transformers
directory: ``config.json``, ``model.safetensors`` and ``tokenizer.json``.

Written here rather than taken from mlx-embeddings: that package imports mlx-vlm at
load (``mlx_embeddings.utils``), which pulls opencv, mlx-audio and datasets into every
worker; its BERT is this same graph. Numerics follow Hugging Face's ``BertModel``:
absolute position embeddings, post-LayerNorm blocks, exact GELU, padded keys masked out.

RoBERTa and XLM-RoBERTa (multilingual-e5, bge-m3, paraphrase-multilingual...) are the same
graph with positions counted from ``pad_token_id + 1`` (Hugging Face's
``create_position_ids_from_input_ids``), one token type, and weights under ``roberta.``:
their usable length is the position table less that offset (512 of 514).

ModernBERT (rotary positions, alternating local and global attention, GLU blocks) has its
own graph in ``worker.engine.modernbert``; :func:`load_encoder` takes either.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from tokenizers import Tokenizer

from worker.engine.modernbert import ModernBertConfig, ModernBertModel

#: ``model_type`` values run as encoders (ModernBERT by ``worker.engine.modernbert``).
ENCODER_TYPES = frozenset({"bert", "roberta", "xlm-roberta", "modernbert"})
#: Those whose positions start past the padding index.
ROBERTA_TYPES = frozenset({"roberta", "xlm-roberta"})


def position_offset(config: dict[str, Any]) -> int:
    """The first position a token takes: ``pad_token_id + 1`` for RoBERTa's kind, else 0."""
    if config.get("model_type") in ROBERTA_TYPES:
        return int(config.get("pad_token_id", 1)) + 1
    return 0


def usable_positions(config: dict[str, Any]) -> int | None:
    """The most tokens one input may have: the position table less the offset."""
    size = config.get("max_position_embeddings")
    return int(size) - position_offset(config) if size else None


@dataclass(frozen=True)
class BertConfig:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    max_position_embeddings: int
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    position_offset: int = 0  # RoBERTa's: pad_token_id + 1

    @classmethod
    def of(cls, config: dict[str, Any]) -> BertConfig:
        names = cls.__dataclass_fields__
        given = {k: v for k, v in config.items() if k in names and k != "position_offset"}
        return cls(**given, position_offset=position_offset(config))


class _Attention(nn.Module):
    def __init__(self, c: BertConfig) -> None:
        super().__init__()
        self.heads = c.num_attention_heads
        self.query = nn.Linear(c.hidden_size, c.hidden_size)
        self.key = nn.Linear(c.hidden_size, c.hidden_size)
        self.value = nn.Linear(c.hidden_size, c.hidden_size)

    def __call__(self, x: mx.array, mask: mx.array) -> mx.array:
        b, n, d = x.shape
        q, k, v = (
            p(x).reshape(b, n, self.heads, -1).transpose(0, 2, 1, 3)
            for p in (self.query, self.key, self.value)
        )
        scale = (d // self.heads) ** -0.5
        out = mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)
        return out.transpose(0, 2, 1, 3).reshape(b, n, d)


class _Dense(nn.Module):
    """A projection, then LayerNorm of it plus the residual (BERT's ``*Output`` blocks)."""

    def __init__(self, n_in: int, c: BertConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(n_in, c.hidden_size)
        self.LayerNorm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)

    def __call__(self, x: mx.array, residual: mx.array) -> mx.array:
        return self.LayerNorm(self.dense(x) + residual)


class _SelfAttention(nn.Module):
    def __init__(self, c: BertConfig) -> None:
        super().__init__()
        self.self = _Attention(c)
        self.output = _Dense(c.hidden_size, c)


class _Intermediate(nn.Module):
    def __init__(self, c: BertConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(c.hidden_size, c.intermediate_size)


class _Layer(nn.Module):
    def __init__(self, c: BertConfig) -> None:
        super().__init__()
        self.attention = _SelfAttention(c)
        self.intermediate = _Intermediate(c)
        self.output = _Dense(c.intermediate_size, c)

    def __call__(self, x: mx.array, mask: mx.array) -> mx.array:
        h = self.attention.output(self.attention.self(x, mask), x)
        return self.output(nn.gelu(self.intermediate.dense(h)), h)


class _Embeddings(nn.Module):
    def __init__(self, c: BertConfig) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(c.vocab_size, c.hidden_size)
        self.position_embeddings = nn.Embedding(c.max_position_embeddings, c.hidden_size)
        self.token_type_embeddings = nn.Embedding(c.type_vocab_size, c.hidden_size)
        self.LayerNorm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)
        self.offset = c.position_offset

    def __call__(self, ids: mx.array) -> mx.array:
        # (padding on the right: real tokens take offset, offset + 1...; a pad token's
        # position, masked out of every key and of pooling, does not matter)
        positions = (mx.arange(ids.shape[1]) + self.offset)[None]
        x = self.word_embeddings(ids) + self.position_embeddings(positions)
        return self.LayerNorm(x + self.token_type_embeddings(mx.zeros_like(ids)))


class _Encoder(nn.Module):
    def __init__(self, c: BertConfig) -> None:
        super().__init__()
        self.layer = [_Layer(c) for _ in range(c.num_hidden_layers)]


class BertModel(nn.Module):
    """Token ids (padded, with a 0/1 mask) to the last hidden states."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.config = config
        self.embeddings = _Embeddings(config)
        self.encoder = _Encoder(config)

    def __call__(self, ids: mx.array, mask: mx.array) -> mx.array:
        x = self.embeddings(ids)
        # padded keys get no weight; an additive mask in the activations' dtype
        bias = ((1.0 - mask.astype(x.dtype)) * -1e9).astype(x.dtype)[:, None, None, :]
        for layer in self.encoder.layer:
            x = layer(x, bias)
        return x


def load_encoder(path: Path, config: dict[str, Any]) -> nn.Module:
    """The BERT, RoBERTa or ModernBERT model in ``path`` (weights with or without a
    ``bert.``, ``roberta.`` or ``model.`` prefix; the pooler and pretraining heads are not
    needed for sentence embeddings)."""
    model: nn.Module
    if config.get("model_type") == "modernbert":
        model = ModernBertModel(ModernBertConfig.of(config))
    else:
        model = BertModel(BertConfig.of(config))
    weights: dict[str, mx.array] = {}
    for file in sorted(path.glob("*.safetensors")):
        weights.update(mx.load(str(file)))  # type: ignore[arg-type]
    wanted = {k for k, _ in tree_flatten(model.parameters())}
    kept = {}
    for name, value in weights.items():
        name = name.removeprefix("bert.").removeprefix("roberta.").removeprefix("model.")
        if name in wanted:
            kept[name] = value
    missing = wanted - kept.keys()
    if missing:
        raise ValueError(f"weights missing from {path}: {', '.join(sorted(missing)[:5])}")
    model.load_weights(list(kept.items()))
    mx.eval(model.parameters())
    model.eval()
    return model


def encoder_tokenizer(path: Path) -> Tokenizer:
    """The model's fast tokenizer (``tokenizer.json``), with no padding or truncation of its
    own: the embedder pads, and inputs longer than the context are refused, not cut."""
    file = path / "tokenizer.json"
    if not file.exists():
        raise ValueError(f"{path} has no tokenizer.json")
    tokenizer = Tokenizer.from_file(str(file))
    tokenizer.no_padding()
    tokenizer.no_truncation()
    return tokenizer
