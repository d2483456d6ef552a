"""Undoing the last positions of a model's cache, exactly, for every cache type mlx-lm makes.

Speculative decoding runs the target over k + 1 tokens and then keeps only the
accepted ones; the draft runs ahead k tokens. Both caches must then be as if the
rejected tokens had never been seen. mlx-lm's ``trim`` does that for a plain
``KVCache`` only: on a sliding-window ``RotatingKVCache`` whose ring has wrapped
it moves an index and leaves the rejected keys in the window, and recurrent state
(``ArraysCache``: linear attention, SSM, conv) cannot be trimmed at all.

Here, per layer (``CacheList`` layers are taken apart):

- ``KVCache`` (and other trimmable types): ``trim``.
- ``RotatingKVCache`` after a pass of several tokens: mlx-lm has just put the
  window in temporal order (the last ``max_size - 1`` old positions, then the new
  ones), so the last n positions are cut off the buffer itself. After single-token
  passes (the draft's) the ring has overwritten what it dropped: the layer is
  checkpointed (copied) first and restored.
- ``ArraysCache``: a checkpoint of its arrays before the pass; restoring it and
  running the model again over the accepted tokens only (the replay).

:func:`unsupported` names layers of any other type: speculation then runs plainly.
Only mlx-lm's public cache attributes are used (``state``, ``offset``, ``trim``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import (
    ArraysCache,
    BatchRotatingKVCache,
    CacheList,
    ChunkedKVCache,
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
)

Cache = list[Any]
#: Layers whose ``trim`` removes the last positions exactly.
_TRIMMABLE = (KVCache, QuantizedKVCache, ChunkedKVCache)


def leaves(cache: Iterable[Any]) -> list[Any]:
    """Every layer's caches, ``CacheList`` layers taken apart."""
    out: list[Any] = []
    for c in cache:
        if isinstance(c, CacheList):
            out.extend(leaves(c.caches))
        else:
            out.append(c)
    return out


def unsupported(cache: Cache, batch: bool = False) -> str | None:
    """Why speculation cannot be exact on ``cache`` (cache types it cannot rewind; in a
    ``batch``, types mlx-lm does not batch), or None."""
    ok = (
        (KVCache, RotatingKVCache, ArraysCache)
        if batch
        else (*_TRIMMABLE, RotatingKVCache, ArraysCache)
    )
    odd = sorted(
        {type(c).__name__ for c in leaves(cache) if type(c) not in ok and not _batchable(c)}
    )
    return f"cache types {', '.join(odd)} cannot be rewound" if odd else None


def _batchable(c: Any) -> bool:
    """A quantized KV layer mlxq batches (``worker.engine.kvquant.QuantizedKV``)."""
    return isinstance(c, QuantizedKVCache) and hasattr(c, "merge")


def needs_replay(cache: Cache) -> bool:
    """True if undoing a pass on ``cache`` means restoring a checkpoint and running the
    model again over the tokens kept (recurrent state), not cutting positions off."""
    return any(isinstance(c, ArraysCache) for c in leaves(cache))


def describe(cache: Cache) -> str:
    """The kinds of layer in ``cache``: "kv", "sliding-window", "recurrent" (joined)."""
    kinds = []
    ls = leaves(cache)
    if any(isinstance(c, _TRIMMABLE) for c in ls):
        kinds.append("kv")
    if any(isinstance(c, RotatingKVCache) for c in ls):
        kinds.append("sliding-window")
    if any(isinstance(c, ArraysCache) for c in ls):
        kinds.append("recurrent")
    return "+".join(kinds) or "empty"


def _copy(x: Any) -> Any:
    return mx.array(x) if isinstance(x, mx.array) else x


def checkpoint(cache: Cache, *, copy: bool = False) -> list[Any]:
    """What :func:`restore` needs to bring ``cache`` back to now. ``copy``: copy the
    sliding-window buffers too (single-token passes write into them in place)."""
    marks: list[Any] = []
    for c in leaves(cache):
        if isinstance(c, RotatingKVCache):
            keys, values, *meta = c.state
            marks.append((_copy(keys), _copy(values), *meta) if copy else (keys, values, *meta))
        elif isinstance(c, ArraysCache):
            arrays, left_padding, lengths = c.state
            marks.append((list(arrays), left_padding, lengths))
        else:
            marks.append(c.offset)
    return marks


def restore(cache: Cache, marks: list[Any]) -> None:
    """Bring ``cache`` back to its :func:`checkpoint`."""
    for c, mark in zip(leaves(cache), marks, strict=True):
        if isinstance(c, (RotatingKVCache, ArraysCache)):
            c.state = mark if isinstance(c, RotatingKVCache) else (list(mark[0]), *mark[1:])
        else:
            c.trim(c.offset - mark)


def wraps(cache: Cache, tokens: int) -> bool:
    """True if ``tokens`` more positions would wrap a sliding window of ``cache`` (after
    which its ``trim`` is no longer exact)."""
    return any(
        isinstance(c, RotatingKVCache) and c.offset + tokens >= c.max_size for c in leaves(cache)
    )


def trim(cache: Cache, n: int) -> None:
    """mlx-lm's own ``trim`` of every layer: exact only while no sliding window has
    wrapped (see :func:`wraps`) and there is no recurrent layer."""
    if n > 0:
        for c in leaves(cache):
            c.trim(n)


def cut(cache: Cache, n: int) -> None:
    """Remove the last ``n`` positions of ``cache`` right after a pass of more than ``n``
    tokens on it (no recurrent layers: see :func:`needs_replay`)."""
    if n <= 0:
        return
    for c in leaves(cache):
        if isinstance(c, RotatingKVCache):
            keys, values, offset, keep, max_size, idx = c.state
            if idx != keys.shape[2]:
                raise RuntimeError("a sliding window is cut only right after a multi-token pass")
            m = idx - n
            c.state = (keys[..., :m, :], values[..., :m, :], offset - n, keep, max_size, m)
        elif isinstance(c, ArraysCache):
            raise RuntimeError("recurrent state cannot be cut: restore and replay")
        else:
            c.trim(n)


# -- batches -------------------------------------------------------------------
def batch_checkpoint(cache: Cache, *, copy: bool = False) -> list[Any]:
    """What :func:`batch_restore` needs to bring a batch's ``cache`` back to now. Buffers
    are kept by reference (a pass of several tokens writes a KV buffer only past the
    rows' ends, and builds a sliding window anew) unless ``copy`` (single-token passes
    write a window's ring in place); per-row offsets and paddings are copied."""
    marks: list[Any] = []
    for c in leaves(cache):
        if isinstance(c, ArraysCache):
            arrays, left_padding, lengths = c.state
            marks.append((list(arrays), _copy(left_padding), _copy(lengths)))
            continue
        keys, values, *rest = c.state
        if copy and isinstance(c, BatchRotatingKVCache):
            keys, values = _copy(keys), _copy(values)
        marks.append((keys, values, *(_copy(x) for x in rest)))
    return marks


def batch_restore(cache: Cache, marks: list[Any]) -> None:
    """Bring a batch's ``cache`` back to its :func:`batch_checkpoint`."""
    for c, mark in zip(leaves(cache), marks, strict=True):
        if isinstance(c, ArraysCache):
            c.state = (list(mark[0]), _copy(mark[1]), _copy(mark[2]))
        else:
            c.state = tuple(_copy(x) if i >= 2 else x for i, x in enumerate(mark))
