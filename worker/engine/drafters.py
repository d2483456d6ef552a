"""Drafters beside an mlx-lm target: heads that propose from the target's hidden states.

A drafter (an EAGLE-3 head, ``worker.engine.eagle``; a model's own MTP head,
``worker.engine.mtp``) reads the target's states at some of its layers (``Tap``) and
the next token's embedding, and predicts the token after it. Its KV cache holds one
entry per (state at position p, token at p + 1) pair it was fed: the prompt's, as the
target prefills it, then each round's kept tokens with the states the target's verify
pass gave them. Proposing k tokens: the first is the seed its last feed predicted;
each next one runs the head once on the previous token and its own output state
(those k - 1 entries are trimmed off again before the kept ones go in).

Only the proposals come from here: the target verifies them under the speculative
engine's rule, so what a head misses (a kept prefix it never saw, an untrained head)
costs acceptance, never exactness. ``Rows`` holds a batch's head state: fed
right-padded, filtered and extended like the target's caches. The heads' modules and
loaders are mlx-vlm's; its round loops need its own models' hooks, so the round is the
speculative engine's.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import BatchKVCache

from schemas.figures import MTP_ID
from worker.engine.hidden import Tap, layers_of

#: What a job names as its ``draft_model`` to use the target's own MTP head(s).
MTP = MTP_ID


#: Architectures that make a checkpoint a block drafter whatever its model_type.
_BLOCK_DRAFTERS = {"DFlash2DraftModel", "Gemma4DSparkModel"}


def drafter_type(config: dict[str, Any]) -> str | None:
    """The drafter family a checkpoint's config declares (EAGLE-3, DFlash, an MTP
    head...), by mlx-vlm's table of drafter types; None for a model of its own. A
    DFlash drafter declares a chat model's type (``qwen3``) and a ``dflash_config``:
    its type is mlx-vlm's reading (``qwen3_dflash``, ``dspark``...). Another type
    mlx-lm implements is a chat model (mlx-vlm's table also lists ``laguna``, a chat
    model in mlx-lm), and its config is read without importing mlx-vlm."""
    kind = config.get("speculators_model_type") or config.get("model_type")
    if not isinstance(kind, str) or not kind.isidentifier():
        return None
    archs = config.get("architectures")
    blocks = isinstance(archs, list) and bool(_BLOCK_DRAFTERS.intersection(map(str, archs)))
    if isinstance(config.get("dflash_config"), dict) or blocks:
        from mlx_vlm.utils import get_model_type

        return get_model_type(config)
    if importlib.util.find_spec(f"mlx_lm.models.{kind}") is not None:
        return None
    from mlx_vlm.speculative.drafters import DRAFTER_KIND_BY_MODEL_TYPE

    return kind if kind in DRAFTER_KIND_BY_MODEL_TYPE else None


class State(Protocol):
    """A head's state for the rows of one batch (``Rows``; ``dflash.Block``)."""

    caches: list[Any] | None

    def __len__(self) -> int: ...
    def add(self, n: int) -> State: ...
    def feed(self, states: mx.array | None, tokens: list[list[int]]) -> None: ...
    def propose(self, k: int) -> mx.array: ...
    def filter(self, keep: list[int]) -> None: ...
    def extend(self, other: Any) -> None: ...


class Head:
    """A loaded drafter bound to one target: what it reads, how it steps and predicts.
    Subclasses: ``eagle.Eagle3``, ``mtp.QwenMTP``, ``dflash.DFlash``."""

    #: The target's layers whose outputs it reads (``Tap``), in order.
    reads: list[int]
    #: Its records' ``speculation_method``.
    method: str

    def __init__(self, module: nn.Module, target: nn.Module) -> None:
        self.module = module
        self.tap = Tap(target, self.reads)
        self.layers: list[nn.Module] = list(module.layers)
        self.hidden_size = 0
        self.dtype = mx.float32

    def rows(self) -> State:
        return Rows(self)

    def from_target(self, states: mx.array) -> mx.array:
        """The target's states (the tap's, concatenated) as the head's input states."""
        raise NotImplementedError

    def forward(self, tokens: mx.array, states: mx.array, caches: list[Any]) -> mx.array:
        """The head over (B, L) ``tokens``, each paired with the state before it (from
        :meth:`from_target`, or the head's own output): its output states."""
        raise NotImplementedError

    def logits(self, h: mx.array) -> mx.array:
        """Its logits (over its own vocabulary) from output states ``h``."""
        raise NotImplementedError

    def predict(self, h: mx.array) -> mx.array:
        """Its greedy token (in the target's vocabulary) from output states ``h``."""
        return mx.argmax(self.logits(h), axis=-1).astype(mx.uint32)


@contextmanager
def right_padded(caches: list[Any], lens: list[int]) -> Iterator[int]:
    """``caches`` taking one pass over rows of ``lens`` tokens, right-padded to the
    longest (its width, yielded): their padding goes left after the pass."""
    width = max(lens, default=0)
    pad = [width - n for n in lens]
    if max(pad, default=0):
        for c in caches:
            c.prepare(lengths=lens, right_padding=pad)
    yield width
    if max(pad, default=0):
        for c in caches:
            c.finalize()


def target_layers(target: nn.Module) -> int:
    return len(layers_of(target))


@dataclass
class Rows:
    """A head's state for the rows of one batch: its caches, and per row the token its
    last feed predicted (the next proposal's first) and the state that came with it."""

    head: Head
    caches: list[Any] | None = None
    seed: mx.array | None = None  # (B,) uint32
    state: mx.array | None = None  # (B, 1, head size)
    appended: int = 0  # entries the last proposal added (trimmed before the next feed)

    def __len__(self) -> int:
        return 0 if self.seed is None else int(self.seed.shape[0])

    def add(self, n: int) -> Rows:
        """``n`` new rows with nothing fed yet (their first proposals are guesses), as a
        Rows of their own to feed and then :meth:`extend` this one with."""
        rows = Rows(self.head, [BatchKVCache([0] * n) for _ in self.head.layers])
        rows.seed = mx.zeros((n,), mx.uint32)
        rows.state = mx.zeros((n, 1, self.head.hidden_size), self.head.dtype)
        return rows

    def feed(self, states: mx.array | None, tokens: list[list[int]]) -> None:
        """Feed each row its (target state at p, token at p + 1) pairs: ``tokens[i]``
        with ``states[i, :len(tokens[i])]`` (right-padded rows); a row fed something
        gets a new seed."""
        assert self.caches is not None and self.seed is not None and self.state is not None
        for c in self.caches:  # what the last proposal appended goes first
            c.trim(self.appended)
        self.appended = 0
        lens = [len(t) for t in tokens]
        if states is None or max(lens, default=0) == 0:
            return
        with right_padded(self.caches, lens) as width:
            ids = mx.array([t + [0] * (width - len(t)) for t in tokens], mx.uint32)
            h = self.head.forward(ids, self.head.from_target(states[:, :width]), self.caches)
        last = mx.array([max(n - 1, 0) for n in lens])
        h_last = mx.take_along_axis(h, last[:, None, None], axis=1)  # (B, 1, size)
        fed = mx.array([n > 0 for n in lens])
        self.seed = mx.where(fed, self.head.predict(h_last)[:, 0], self.seed)
        self.state = mx.where(fed[:, None, None], h_last, self.state)
        mx.eval(self.seed, self.state, [c.state for c in self.caches])

    def propose(self, k: int) -> mx.array:
        """``k`` proposals per row, (B, k): the seed, then k - 1 head steps."""
        assert self.caches is not None and self.seed is not None and self.state is not None
        token, h = self.seed, self.state
        out = [token]
        for _ in range(k - 1):
            h = self.head.forward(token[:, None], h, self.caches)
            token = self.head.predict(h)[:, 0]
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
