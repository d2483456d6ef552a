"""DFlash block drafters: one pass of the drafter proposes a whole block.

A DFlash drafter (mlx-vlm's ``DFlashDraftModel``; z-lab's checkpoints declare a
``dflash_config``) reads the target's states at several layers, projected (``fc``,
``hidden_norm``) into the keys and values of each of its layers: its cache holds one
context entry per position the target processed. Proposing k tokens is one pass over
the block (the row's last token, then k mask tokens), each position attending to the
whole context and, not causally, to the block itself; its logits come through the
target's own output layer, its embedding is the target's. The block's own entries
are trimmed after the pass: the kept tokens' states come with the verify pass (the
next feed). ``Block`` holds a batch's state, fed right-padded, filtered and extended
like ``worker.engine.drafters.Rows``; the speculative engine runs either.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import BatchKVCache

from worker.engine.drafters import Head, right_padded, target_layers

#: Drafter types (as mlx-vlm names them) of this kind that mlxq runs.
RUNS = ("qwen3_dflash",)


def is_dflash(module: nn.Module) -> bool:
    cfg = module.config
    return hasattr(cfg, "mask_token_id") and hasattr(cfg, "target_layer_ids")


def why_not_run(module: nn.Module) -> str | None:
    """Why mlxq does not run this DFlash drafter's shape (sliding or causal layers, a
    draft window), or None."""
    cfg = module.config
    if any(t != "full_attention" for t in cfg.layer_types):
        return f"its layers are {sorted(set(cfg.layer_types))}: mlxq runs full-attention DFlash"
    if cfg.is_causal or cfg.draft_window_size:
        return "a causal or windowed DFlash drafter: mlxq runs full-attention, non-causal DFlash"
    return None


def _inner(target: nn.Module) -> nn.Module:
    lm = getattr(target, "language_model", target)
    return getattr(lm, "model", lm)


def why_not(module: nn.Module, target: nn.Module, vocab: int) -> str | None:
    """Why ``module`` cannot draft for ``target`` (state size, layers read, the mask
    token, a scaled embedding), or None."""
    cfg = module.config
    kind = str(getattr(getattr(target, "args", None), "model_type", ""))
    if kind.startswith("gemma"):
        return f"a {kind} target scales its embedding: mlxq runs DFlash on unscaled ones"
    embed = getattr(_inner(target), "embed_tokens", None)
    if embed is None or int(embed.weight.shape[-1]) != int(cfg.hidden_size):
        return f"its states are {cfg.hidden_size} wide; the target's embedding is not"
    layers, reads = target_layers(target), list(cfg.target_layer_ids)
    if max(reads, default=0) >= layers or int(cfg.num_target_layers) != layers:
        return (
            f"it was trained on a target of {cfg.num_target_layers} layers, the target has {layers}"
        )
    if not 0 <= int(cfg.mask_token_id) < vocab:
        return f"its mask token {cfg.mask_token_id} is outside the target's {vocab} tokens"
    return None


class DFlash(Head):
    """A DFlash drafter bound to its target (whose embedding and output layer it reads)."""

    method = "dflash"

    def __init__(self, module: nn.Module, target: nn.Module) -> None:
        self.reads = list(module.config.target_layer_ids)
        super().__init__(module, target)
        lm = getattr(target, "language_model", target)
        self.embed = _inner(target).embed_tokens
        module.embed_tokens = self.embed  # (a copy of its own, if it shipped one, is freed)
        head = getattr(lm, "lm_head", None)
        self.output = head if head is not None else self.embed.as_linear
        self.mask = int(module.config.mask_token_id)
        self.hidden_size = int(module.config.hidden_size)
        self.dtype = module.norm.weight.dtype

    def rows(self) -> Block:  # type: ignore[override]
        return Block(self)

    def from_target(self, states: mx.array) -> mx.array:
        m = self.module
        return m.hidden_norm(m.fc(states))

    def context(self, states: mx.array, caches: list[Any]) -> None:
        """The target's ``states`` (B, W, n * H) as context entries of every layer."""
        m = self.module
        ctx = self.from_target(states)
        b, w, _ = ctx.shape
        for layer, c in zip(m.layers, caches, strict=True):
            a = layer.self_attn
            keys = a.k_norm(a.k_proj(ctx).reshape(b, w, a.n_kv_heads, -1)).transpose(0, 2, 1, 3)
            values = a.v_proj(ctx).reshape(b, w, a.n_kv_heads, -1).transpose(0, 2, 1, 3)
            c.update_and_fetch(m.rope(keys, offset=c.offset), values)

    def _attend(self, a: nn.Module, x: mx.array, c: Any) -> mx.array:
        """One layer's attention of the block ``x`` over its context and itself (not
        causal; rows' left padding masked); the block's entries stay until trimmed."""
        b, n, _ = x.shape
        q = a.q_norm(a.q_proj(x).reshape(b, n, a.n_heads, -1)).transpose(0, 2, 1, 3)
        k = a.k_norm(a.k_proj(x).reshape(b, n, a.n_kv_heads, -1)).transpose(0, 2, 1, 3)
        v = a.v_proj(x).reshape(b, n, a.n_kv_heads, -1).transpose(0, 2, 1, 3)
        rope = self.module.rope
        keys, values = c.update_and_fetch(rope(k, offset=c.offset), v)
        q = rope(q, offset=c.offset - n)  # (the block's positions, as its keys')
        mask = (mx.arange(keys.shape[2])[None] >= c.left_padding[:, None])[:, None, None, :]
        o = mx.fast.scaled_dot_product_attention(
            q, keys, values, scale=a.scale, mask=mask, sinks=a.attention_sink_bias
        )
        return a.o_proj(o.transpose(0, 2, 1, 3).reshape(b, n, -1))

    def block_logits(self, block: mx.array, caches: list[Any]) -> mx.array:
        """Logits for the (B, L) block's positions after its first, (B, L - 1, V), over
        the context in ``caches`` (left as it was)."""
        m = self.module
        h = self.embed(block)
        for layer, c in zip(m.layers, caches, strict=True):
            h = h + self._attend(layer.self_attn, layer.input_layernorm(h), c)
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        for c in caches:
            c.trim(block.shape[1])
        return self.logits(m.norm(h[:, 1:]))

    def draft(self, block: mx.array, caches: list[Any]) -> mx.array:
        """Greedy tokens for the block's positions after its first, (B, L - 1)."""
        return mx.argmax(self.block_logits(block, caches), axis=-1).astype(mx.uint32)

    def logits(self, h: mx.array) -> mx.array:
        cap = self.module.config.final_logit_softcapping
        logits = self.output(h)
        return logits if cap is None else mx.tanh(logits / cap) * cap


@dataclass
class Block:
    """A DFlash drafter's state for the rows of one batch: its context caches and per row
    the token its next block starts with (the last one fed)."""

    head: DFlash
    caches: list[Any] | None = None
    last: mx.array | None = None  # (B,) uint32

    def __len__(self) -> int:
        return 0 if self.last is None else int(self.last.shape[0])

    def add(self, n: int) -> Block:
        """``n`` new rows with no context yet, to feed and then :meth:`extend` with."""
        caches = [BatchKVCache([0] * n) for _ in self.head.layers]
        return Block(self.head, caches, mx.zeros((n,), mx.uint32))

    def feed(self, states: mx.array | None, tokens: list[list[int]]) -> None:
        """Each row's target states at p (``states[i, :len(tokens[i])]``, right-padded)
        as context; its last token ``tokens[i][-1]`` starts its next block."""
        assert self.caches is not None and self.last is not None
        lens = [len(t) for t in tokens]
        if states is None or max(lens, default=0) == 0:
            return
        with right_padded(self.caches, lens) as width:
            self.head.context(states[:, :width], self.caches)
        new = mx.array([t[-1] if t else 0 for t in tokens], mx.uint32)
        self.last = mx.where(mx.array([n > 0 for n in lens]), new, self.last)
        mx.eval(self.last, [c.state for c in self.caches])

    def propose(self, k: int) -> mx.array:
        """``k`` proposals per row, (B, k), from one pass over each row's block."""
        assert self.caches is not None and self.last is not None
        masks = mx.full((len(self), k), self.head.mask, mx.uint32)
        return self.head.draft(mx.concatenate([self.last[:, None], masks], axis=1), self.caches)

    def filter(self, keep: list[int]) -> None:
        assert self.caches is not None and self.last is not None
        idx = mx.array(keep)
        for c in self.caches:
            c.filter(idx)
        self.last = self.last[idx]

    def extend(self, other: Block) -> None:
        """``other``'s rows after this one's."""
        if self.caches is None or not len(self):
            self.caches, self.last = other.caches, other.last
            return
        assert other.caches is not None and self.last is not None
        for c, o in zip(self.caches, other.caches, strict=True):
            c.extend(o)
        self.last = mx.concatenate([self.last, other.last])
