"""Sentence embeddings: an encoder's (or a decoder embedder's) hidden states pooled into
one vector per input, as the model's sentence-transformers files say.

``modules.json`` lists the modules (Transformer, Pooling, Normalize); the Pooling
module's ``config.json`` names the mode (mean, cls, max, mean_sqrt_len, lasttoken).
A directory with such a pooling module is an embedding model; an encoder (BERT) is one
whatever its files say (mean pooling, as sentence-transformers defaults to). Inputs are
embedded in micro-batches sorted by length (little padding) under a token budget; each
row's vector is independent of what it was batched with (padded keys are masked out,
and causal decoders pad on the right).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from schemas import ContextLengthError, GenerationError
from worker.engine.encoder import usable_positions

#: Pooling modes, by the key of ``1_Pooling/config.json`` that turns each on.
POOLING_KEYS = {
    "cls": "pooling_mode_cls_token",
    "mean": "pooling_mode_mean_tokens",
    "max": "pooling_mode_max_tokens",
    "mean_sqrt_len": "pooling_mode_mean_sqrt_len_tokens",
    "lasttoken": "pooling_mode_lasttoken",
}
#: Padded tokens one forward pass may hold (micro-batch rows x longest row).
TOKEN_BUDGET = 8192
#: Where mlx-lm's decoders keep their stack of layers (the hidden states pooled).
BODIES = ("model", "backbone")
#: A row joins a micro-batch only if at least this share of the batch's longest row.
SAME_LENGTH = 0.9
#: Bytes of attention scores one forward pass may hold (rows x heads x longest row^2).
SCORE_BUDGET = 256 * 2**20


@dataclass(frozen=True)
class Pooling:
    """How hidden states become one vector: the mode, normalised or not, the dimensions
    it gives, and whether shorter vectors (``dimensions``) are meaningful."""

    mode: str
    normalize: bool
    dims: int
    truncatable: bool = False
    max_tokens: int | None = None  # sentence-transformers' max_seq_length, if it says


def pooling_of(path: Path, config: dict[str, Any], encoder: bool) -> Pooling | None:
    """The model's pooling, or None when ``path`` is not an embedding model (a decoder
    without a sentence-transformers Pooling module is a chat model)."""
    modules = read_json(path / "modules.json") or []
    kinds = {m.get("type", "").rsplit(".", 1)[-1]: m for m in modules if isinstance(m, dict)}
    dims = int(config.get("hidden_size") or 0)
    st = read_json(path / "sentence_bert_config.json") or {}
    st_config = read_json(path / "config_sentence_transformers.json") or {}
    truncatable = bool(st_config.get("truncate_dim") or config.get("matryoshka_dimensions"))
    common = {"dims": dims, "truncatable": truncatable, "max_tokens": st.get("max_seq_length")}
    if "Pooling" not in kinds:
        return Pooling("mean", "Normalize" in kinds, **common) if encoder else None
    pool = read_json(path / kinds["Pooling"].get("path", "") / "config.json") or {}
    modes = [m for m, key in POOLING_KEYS.items() if pool.get(key)]
    if len(modes) > 1:
        raise ValueError(f"pooling modes {' + '.join(modes)} (concatenated) are not supported")
    mode = modes[0] if modes else "mean"
    return Pooling(mode, "Normalize" in kinds, **common)


def read_json(path: Path) -> Any:
    """A JSON file's content, or None when it is absent."""
    return json.loads(path.read_text()) if path.exists() else None


def pool(hidden: mx.array, mask: mx.array, lengths: mx.array, mode: str) -> mx.array:
    """One vector per row of ``hidden`` (rows x tokens x dims), padded tokens left out."""
    hidden = hidden.astype(mx.float32)
    m = mask.astype(mx.float32)[..., None]
    if mode == "cls":
        return hidden[:, 0]
    if mode == "lasttoken":
        return mx.take_along_axis(hidden, (lengths - 1)[:, None, None], axis=1)[:, 0]
    if mode == "max":
        return mx.max(mx.where(m > 0, hidden, -mx.inf), axis=1)
    # where, not a product: whatever a padded position holds (an inf, a NaN) stays out
    total = mx.sum(mx.where(m > 0, hidden, 0.0), axis=1)
    count = mx.maximum(mx.sum(m, axis=1), 1.0)
    return total / (mx.sqrt(count) if mode == "mean_sqrt_len" else count)


def normalized(vectors: np.ndarray) -> np.ndarray:
    norms = np.linalg.norm(vectors, axis=-1, keepdims=True)
    return vectors / np.maximum(norms, 1e-12)


def micro_batches(lengths: Sequence[int], heads: int) -> list[list[int]]:
    """Indices of ``lengths`` grouped for forward passes: sorted longest first, each group
    within :data:`TOKEN_BUDGET` padded tokens and :data:`SCORE_BUDGET` of scores, and of
    rows at least :data:`SAME_LENGTH` of its longest (padding at most ~5% of the compute:
    10-60-token texts in pools of 256 padded 36% more without it)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    groups: list[list[int]] = []
    for i in order:
        if groups:
            longest = lengths[groups[-1][0]]
            rows = len(groups[-1]) + 1
            fits = rows * longest <= TOKEN_BUDGET and rows * heads * longest**2 * 4 <= SCORE_BUDGET
            if fits and lengths[i] >= SAME_LENGTH * longest:
                groups[-1].append(i)
                continue
        groups.append([i])
    return groups


def forward_bytes(rows: int, longest: int, dims: int, heads: int) -> int:
    """What one forward pass of ``rows`` x ``longest`` tokens holds at its peak (bytes, in
    float32): a few hidden-state copies and one layer's attention scores."""
    return 4 * rows * longest * (8 * dims + heads * longest)


class Embedder:
    """Embeds token lists with one loaded embedding model."""

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        pooling: Pooling,
        config: dict[str, Any],
        decoder: bool,
    ) -> None:
        self.model, self.tokenizer, self.pooling, self.decoder = model, tokenizer, pooling, decoder
        #: A decoder's stack before its output layer (mlx-lm names it ``model``, or
        #: ``backbone`` in its Mamba-style hybrids): what is pooled.
        self.body = next((getattr(model, n) for n in BODIES if hasattr(model, n)), None)
        if decoder and self.body is None:
            raise ValueError(f"{type(model).__module__} has no {' or '.join(BODIES)} to pool")
        self.heads = int(config.get("num_attention_heads") or 1)
        self.vocab_size = int(config.get("vocab_size") or 0)
        limits = [pooling.max_tokens, usable_positions(config)]
        #: The most tokens one input may have (sentence-transformers' max_seq_length, else
        #: the model's positions), or None when nothing says.
        self.context: int | None = min((int(x) for x in limits if x), default=None)

    def tokenize(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of each text, with the special tokens the model's tokenizer adds."""
        if self.decoder:
            return [list(self.tokenizer.encode(t)) for t in texts]
        return [list(e.ids) for e in self.tokenizer.encode_batch(list(texts))]

    def embed(self, inputs: Sequence[Sequence[int]]) -> np.ndarray:
        """One pooled (and, if the model says so, normalised) float32 vector per input."""
        out = np.zeros((len(inputs), self.pooling.dims), dtype=np.float32)
        for group in micro_batches([len(t) for t in inputs], self.heads):
            out[group] = self.forward([inputs[i] for i in group])
        return normalized(out) if self.pooling.normalize else out

    def forward(self, rows: Sequence[Sequence[int]]) -> np.ndarray:
        """One padded forward pass over ``rows``: their pooled vectors, not normalised (a
        row's vector does not depend on the others in the pass). A row longer than the
        model's positions is refused (an absolute position table read past its end gives
        garbage, NaN now and then); a result that is not finite fails, naming it."""
        longest = max(len(r) for r in rows)
        if self.context is not None and longest > self.context:
            raise ContextLengthError(
                f"an input of {longest} tokens is longer than the model's {self.context}"
            )
        out = self._pass(rows)
        if not np.isfinite(out).all():
            raise GenerationError("the model produced non-finite values (NaN or inf)")
        return out

    def _pass(self, rows: Sequence[Sequence[int]]) -> np.ndarray:
        longest = max(len(r) for r in rows)
        ids = np.zeros((len(rows), longest), dtype=np.int32)
        mask = np.zeros((len(rows), longest), dtype=np.int32)
        for i, r in enumerate(rows):
            ids[i, : len(r)] = r
            mask[i, : len(r)] = 1
        ids_mx, mask_mx = mx.array(ids), mx.array(mask)
        lengths = mx.array([len(r) for r in rows])
        # a causal decoder needs no mask: right padding changes no earlier position
        hidden = self.body(ids_mx) if self.decoder else self.model(ids_mx, mask_mx)
        vectors = pool(hidden, mask_mx, lengths, self.pooling.mode)
        mx.eval(vectors)
        return np.array(vectors, dtype=np.float32)


def shorten(vector: np.ndarray, dims: int, renormalize: bool) -> np.ndarray:
    """The first ``dims`` values (a Matryoshka model's shorter embedding), renormalised
    when the model's vectors are unit length."""
    cut = vector[:dims]
    if not renormalize:
        return cut
    norm = math.sqrt(float(np.dot(cut, cut)))
    return cut / max(norm, 1e-12)
