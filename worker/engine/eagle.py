"""EAGLE-3 drafters beside an mlx-lm target: proposals from the target's hidden states.

An EAGLE-3 drafter (mlx-vlm's ``Eagle3DraftModel``, loaded by its ``load_drafter``) is
one decoder layer that reads three of the target's layers' outputs (``Tap``) and the
next token's embedding, and predicts the token after it. Its own KV cache holds one
entry per (hidden state at position p, token at p + 1) pair it was fed: the prompt's,
as the target prefills it, then each round's kept tokens with the hidden states the
target's verify pass gave them. Proposing k tokens: the first is the seed its last
feed predicted; each next one runs the drafter once on the previous token and its own
output state (those k - 1 entries are trimmed off again before the kept ones go in).

Only the proposals come from here: the target verifies them under the speculative
engine's rule, so what a drafter misses (a kept prefix it never saw, an untrained
head) costs acceptance, never exactness. Rows are a batch (``Rows``): fed right-padded,
filtered and extended like the target's caches. mlx-vlm's round loops need its own
models' hooks; mlxq's targets load through mlx-lm, so the round is the engine's and
only the drafter's modules are mlx-vlm's.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import BatchKVCache

from worker.engine.hidden import Tap, layers_of
from worker.engine.memory import KVProfile

#: Drafter ``model_type``s mlxq runs (mlx-vlm's names); any other drafter is refused.
RUNS = ("eagle3",)


def drafter_type(config: dict[str, Any]) -> str | None:
    """The drafter family a checkpoint's config declares (EAGLE-3, DFlash, an MTP
    head...), by mlx-vlm's table of drafter types; None for a model of its own."""
    from mlx_vlm.speculative.drafters import DRAFTER_KIND_BY_MODEL_TYPE

    kind = config.get("speculators_model_type") or config.get("model_type")
    return str(kind) if kind in DRAFTER_KIND_BY_MODEL_TYPE else None


def load(path: Path) -> tuple[nn.Module, dict[str, Any]]:
    """A drafter checkpoint through mlx-vlm's loader, and its config; a ValueError
    naming the family for one mlxq does not run."""
    import json

    config = json.loads((path / "config.json").read_text())
    kind = drafter_type(config)
    if kind not in RUNS:
        raise ValueError(
            f"a {kind} drafter: mlxq runs {', '.join(RUNS)} drafters (its speculation "
            "takes a draft model, prompt lookup or an EAGLE-3 head)"
        )
    from mlx_vlm.speculative import load_drafter

    module, _ = load_drafter(str(path))
    module.eval()
    return module, config


def why_not(module: nn.Module, target: nn.Module, vocab: int) -> str | None:
    """Why ``module`` cannot draft for ``target`` (hidden size, vocabulary, layers read),
    or None."""
    cfg = module.config
    layers = len(layers_of(target))
    reads = list(cfg.capture_layer_ids)
    args = getattr(target, "args", None)
    hidden = getattr(args, "hidden_size", None)
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


def kv_profile(module: nn.Module) -> KVProfile:
    """A drafter's KV bytes per sequence: per token, keys and values of each layer."""
    cfg = module.config.transformer_layer_config
    size = module.norm.weight.dtype.size
    per = 2 * int(cfg.num_key_value_heads) * int(cfg.head_dim) * size * len(module.layers)
    return KVProfile(per)


class Drafter:
    """A loaded EAGLE-3 drafter bound to one target: the target's embedding shared (not
    a second copy) and a tap on the layers it reads."""

    def __init__(self, module: nn.Module, target: nn.Module) -> None:
        self.module = module
        self.tap = Tap(target, list(module.config.capture_layer_ids))
        inner = getattr(target, "model", target)
        embed = getattr(inner, "embed_tokens", None)
        weight = getattr(embed, "weight", None)
        if weight is not None and weight.shape == module.embed_tokens.weight.shape:
            module.embed_tokens = embed  # (its own copy is freed)
        #: The token embedding it reads: its target's (EAGLE-3 trains with it frozen).
        self.embed = module.embed_tokens
        self.hidden_size = int(module.config.transformer_layer_config.hidden_size)
        self.dtype = module.norm.weight.dtype

    def rows(self) -> Rows:
        return Rows(self)

    def forward(self, tokens: mx.array, states: mx.array, caches: list[Any]) -> mx.array:
        """The drafter over (B, L) ``tokens``, each paired with the state before it
        (the target's, (B, L, 3 x its size), or the drafter's own, (B, L, its size))."""
        m = self.module
        if states.shape[-1] != self.hidden_size:
            if m.input_norm is not None:
                states = m.input_norm(states)
            states = m.fc(states)
        embeds = self.embed(tokens)
        position = caches[0].offset + 1  # (mlx-vlm's positions start at 1)
        h = states
        for i, (layer, c) in enumerate(zip(m.layers, caches, strict=True)):
            mask = create_attention_mask(h, c)
            h = layer(embeds, h, mask, c, position) if i == 0 else layer(h, mask, c, position)
        return h

    def predict(self, h: mx.array) -> mx.array:
        """Its greedy token (in the target's vocabulary) from output states ``h``."""
        m = self.module
        h = m.norm(h)
        logits = self.embed.as_linear(h) if m.lm_head is None else m.lm_head(h)
        ids = mx.argmax(logits, axis=-1).astype(mx.int32)
        if m.d2t is not None:
            ids = ids + m.d2t[ids]
        return ids.astype(mx.uint32)


@dataclass
class Rows:
    """A drafter's state for the rows of one batch: its caches, and per row the token
    its last feed predicted (the next proposal's first) and the state that came with it."""

    drafter: Drafter
    caches: list[Any] | None = None
    seed: mx.array | None = None  # (B,) uint32
    state: mx.array | None = None  # (B, 1, drafter size)
    appended: int = 0  # entries the last proposal added (trimmed before the next feed)

    def __len__(self) -> int:
        return 0 if self.seed is None else int(self.seed.shape[0])

    def add(self, n: int) -> Rows:
        """``n`` new rows with nothing fed yet (their first proposals are guesses), as a
        Rows of their own to feed and then :meth:`extend` this one with."""
        rows = Rows(self.drafter, [BatchKVCache([0] * n) for _ in self.drafter.module.layers])
        rows.seed = mx.zeros((n,), mx.uint32)
        rows.state = mx.zeros((n, 1, self.drafter.hidden_size), self.drafter.dtype)
        return rows

    def feed(self, states: mx.array | None, tokens: list[list[int]]) -> None:
        """Feed each row its (state at p, token at p + 1) pairs: ``tokens[i]`` with
        ``states[i, :len(tokens[i])]`` (right-padded rows); a row fed something gets
        a new seed."""
        assert self.caches is not None and self.seed is not None and self.state is not None
        for c in self.caches:  # what the last proposal appended goes first
            c.trim(self.appended)
        self.appended = 0
        lens = [len(t) for t in tokens]
        width = max(lens, default=0)
        if states is None or width == 0:
            return
        pad = [width - n for n in lens]
        if max(pad):
            for c in self.caches:
                c.prepare(lengths=lens, right_padding=pad)
        ids = mx.array([t + [0] * (width - len(t)) for t in tokens], mx.uint32)
        h = self.drafter.forward(ids, states[:, :width], self.caches)
        if max(pad):
            for c in self.caches:
                c.finalize()
        last = mx.array([max(n - 1, 0) for n in lens])
        h_last = mx.take_along_axis(h, last[:, None, None], axis=1)  # (B, 1, size)
        fed = mx.array([n > 0 for n in lens])
        self.seed = mx.where(fed, self.drafter.predict(h_last)[:, 0], self.seed)
        self.state = mx.where(fed[:, None, None], h_last, self.state)
        mx.eval(self.seed, self.state, [c.state for c in self.caches])

    def propose(self, k: int) -> mx.array:
        """``k`` proposals per row, (B, k): the seed, then k - 1 drafter steps."""
        assert self.caches is not None and self.seed is not None and self.state is not None
        token, h = self.seed, self.state
        out = [token]
        for _ in range(k - 1):
            h = self.drafter.forward(token[:, None], h, self.caches)
            token = self.drafter.predict(h)[:, 0]
            out.append(token)
        self.appended = k - 1
        return mx.stack(out, axis=1)

    def filter(self, keep: list[int]) -> None:
        assert self.caches is not None and self.seed is not None and self.state is not None
        idx = mx.array(keep)
        for c in self.caches:
            c.filter(idx)
        self.seed, self.state = self.seed[idx], self.state[idx]

    def extend(self, other: Rows) -> None:
        """``other``'s rows after this one's (each fed, nothing proposed since)."""
        if self.caches is None or not len(self):
            self.caches, self.seed, self.state = other.caches, other.seed, other.state
            return
        assert other.caches is not None and self.seed is not None and self.state is not None
        for c, o in zip(self.caches, other.caches, strict=True):
            c.extend(o)
        self.seed = mx.concatenate([self.seed, other.seed])
        self.state = mx.concatenate([self.state, other.state])
