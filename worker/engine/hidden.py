"""Hidden states of an mlx-lm model's layers, captured during its own forward passes.

Drafters such as EAGLE-3 read the target's hidden states at a few layers. mlx-lm's
models do not return them, and a second copy of the target that does would double its
memory, so the chosen layers of the loaded model record their outputs while a
:class:`Tap` is open: each such layer's class is swapped for a subclass whose call
records its output (the parameters, their names and every other caller are unchanged;
with no tap open the layer only runs).

    with Tap(model, [1, 5, 9]) as tap:
        logits = model(tokens, cache=cache)
    hidden = tap.take()  # (B, L, 3 * hidden_size): the layers' outputs, concatenated
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn

_TAPPED: dict[type, type] = {}


class _Sink:
    """Where a tapped layer writes its output while a tap is open (not a list: a list
    set on an ``nn.Module`` would become one of its children)."""

    def __init__(self) -> None:
        self.arrays: list[mx.array] | None = None


def _tapped(cls: type) -> type:
    """``cls`` with a call that records its output in its sink, made once per class."""
    if cls not in _TAPPED:

        def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
            out = cls.__call__(self, *args, **kwargs)
            sink = self.__dict__.get("_mlxq_sink")
            if sink is not None and sink.arrays is not None:
                if not isinstance(out, mx.array):
                    raise TypeError(f"{cls.__name__} returns {type(out).__name__}, not a state")
                sink.arrays.append(out)
            return out

        _TAPPED[cls] = type(f"Tapped{cls.__name__}", (cls,), {"__call__": __call__})
    return _TAPPED[cls]


def layers_of(model: nn.Module) -> list[nn.Module]:
    """The decoder layers of an mlx-lm model (its ``layers``), or a ValueError."""
    layers = getattr(model, "layers", None)
    if not isinstance(layers, list) or not layers:
        raise ValueError(f"{type(model).__module__} has no list of layers to read states from")
    return layers


class Tap:
    """Records the outputs of ``model``'s layers ``ids`` (in that order) while open."""

    def __init__(self, model: nn.Module, ids: list[int]) -> None:
        layers = layers_of(model)
        bad = [i for i in ids if not 0 <= i < len(layers)]
        if bad:
            raise ValueError(f"layers {bad} do not exist: the model has {len(layers)}")
        self.ids = list(ids)
        self._sinks: list[_Sink] = []
        for i in dict.fromkeys(ids):
            layer = layers[i]
            if "_mlxq_sink" not in layer.__dict__:
                layer.__class__ = _tapped(type(layer))
                object.__setattr__(layer, "_mlxq_sink", _Sink())
            self._sinks.append(layer.__dict__["_mlxq_sink"])
        self._order = list(dict.fromkeys(ids))
        self._chunks: list[mx.array] = []

    def __enter__(self) -> Tap:
        for s in self._sinks:
            s.arrays = []
        return self

    def __exit__(self, *exc: object) -> None:
        got = [s.arrays or [] for s in self._sinks]
        for s in self._sinks:
            s.arrays = None
        if exc[0] is None and got and got[0]:
            by_id = dict(zip(self._order, got, strict=True))
            passes = len(got[0])
            for p in range(passes):  # (a prefill runs the model once per chunk)
                self._chunks.append(mx.concatenate([by_id[i][p] for i in self.ids], axis=-1))

    def take(self) -> mx.array | None:
        """What the passes since the last take recorded, (B, L, len(ids) * hidden),
        concatenated along L; None if none ran."""
        chunks, self._chunks = self._chunks, []
        if not chunks:
            return None
        return chunks[0] if len(chunks) == 1 else mx.concatenate(chunks, axis=1)
