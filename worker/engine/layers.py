"""Copies of a model's cache at a position, for every cache type mlx-lm makes.

What the prefix cache keeps and the n choices of one prompt share: the state of
every layer after a prompt's first n tokens.

- ``KVCache``: its first n positions (a copy that can later be cut shorter); a
  quantized one (``worker.engine.kvquant``) the same, kept quantized.
- ``RotatingKVCache`` (sliding window): the window's positions in temporal order,
  at most ``max_size`` (its attention sinks, ``keep``, first). It can be cut shorter
  only while the window has not wrapped (it still holds every position).
- ``ArraysCache`` (linear attention, SSM, conv state): its arrays, which hold
  exactly n tokens' state and cannot be cut at all.
- ``CacheList``: each part.

A snapshot is taken right after its model ran over exactly n tokens; restoring
gives a fresh cache per job that starts from the kept arrays without copying their
data, but never shares an array object with the snapshot: mlx-lm steps some caches in
place (a wrapped window's one-token update is ``keys[..., i, :] = k``), and
``mx.array.__setitem__`` changes the object it is called on, so a shared object would
change the kept entry under every later job. Only mlx-lm's public cache attributes
(``state``, ``offset``) are used.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import (
    ArraysCache,
    CacheList,
    KVCache,
    RotatingKVCache,
    make_prompt_cache,
)

from worker.engine.kvquant import QuantizedKV
from worker.engine.rewind import leaves

Cache = list[Any]


def _window(c: RotatingKVCache) -> tuple[mx.array, mx.array]:
    """A sliding-window layer's positions in temporal order (at most ``max_size``)."""
    keys, values, offset, keep, max_size, idx = c.state
    held = min(offset, max_size)

    def ordered(v: mx.array) -> mx.array:
        if idx == v.shape[2]:  # right after a multi-token pass: already in order
            order = v
        elif idx < offset:  # the ring has wrapped: oldest at idx
            order = mx.concatenate([v[..., :keep, :], v[..., idx:, :], v[..., keep:idx, :]], 2)
        else:
            order = v[..., :idx, :]
        if order.shape[2] > held:
            tail = order[..., order.shape[2] - (held - keep) :, :]
            order = mx.concatenate([order[..., :keep, :], tail], 2)
        return mx.contiguous(order)

    return ordered(keys), ordered(values)


def _snap(c: Any, n: int) -> Any | None:
    if isinstance(c, CacheList):
        parts = [_snap(p, n) for p in c.caches]
        return None if any(p is None for p in parts) else CacheList(*parts)
    if type(c) is KVCache:
        if c.offset < n:
            return None
        kept = KVCache()
        kept.keys = mx.contiguous(c.keys[..., :n, :])
        kept.values = mx.contiguous(c.values[..., :n, :])
        kept.offset = n
        return kept
    if type(c) is QuantizedKV:
        if c.offset < n:
            return None
        return _quantized_at(c, n, mx.contiguous)
    if type(c) is RotatingKVCache:
        if c.offset != n or c.keys is None:
            return None
        keys, values = _window(c)
        kept = RotatingKVCache(c.max_size, c.keep)
        kept.state = (keys, values, n, c.keep, c.max_size, keys.shape[2])
        return kept
    if type(c) is ArraysCache:
        if c.empty():
            return None
        kept = ArraysCache(len(c.cache))
        kept.cache = [mx.contiguous(a) if a is not None else None for a in c.cache]
        return kept
    return None


def snapshot(cache: Cache, n: int) -> Cache | None:
    """Compact copies of every layer of ``cache`` (which has just run over exactly ``n``
    tokens) at position ``n``; None if a layer cannot be copied that way."""
    if not cache or n <= 0:
        return None
    out = [_snap(c, n) for c in cache]
    if any(c is None for c in out):
        return None
    mx.eval([c.state for c in leaves(out)])
    return out


def shortest(layers: Cache, n: int) -> int:
    """The shortest length a snapshot of ``n`` tokens can be restored at: n itself if a
    layer holds state that cannot be cut (recurrent, or a window that has wrapped)."""
    for c in leaves(layers):
        if isinstance(c, ArraysCache) or (isinstance(c, RotatingKVCache) and n > c.max_size):
            return n
    return 1


def _quantized_at(c: QuantizedKV, n: int, f: Any = None) -> QuantizedKV:
    """A quantized layer's first ``n`` positions (each array through ``f``)."""
    kept = QuantizedKV(c.group_size, c.quant_bits)
    kept.keys = tuple(f(x[..., :n, :]) if f else x[..., :n, :] for x in c.keys)
    kept.values = tuple(f(x[..., :n, :]) if f else x[..., :n, :] for x in c.values)
    kept.offset = n
    return kept


def _fresh(c: Any, n: int) -> Any:
    if isinstance(c, CacheList):
        return CacheList(*(_fresh(p, n) for p in c.caches))
    if isinstance(c, QuantizedKV):
        return _quantized_at(c, n)
    if isinstance(c, RotatingKVCache):
        keys, values, offset, keep, max_size, _ = c.state
        if n != offset:  # (only an unwrapped window: it holds every position)
            keys, values = keys[..., :n, :], values[..., :n, :]
        else:  # arrays of its own: a one-token step writes into the buffer in place
            keys, values = keys[...], values[...]
        fresh = RotatingKVCache(max_size, keep)
        fresh.state = (keys, values, n, keep, max_size, keys.shape[2])
        return fresh
    if isinstance(c, ArraysCache):
        fresh = ArraysCache(len(c.cache))
        fresh.cache = [a[...] if a is not None else None for a in c.cache]
        return fresh
    fresh = KVCache()
    fresh.keys, fresh.values = c.keys[..., :n, :], c.values[..., :n, :]
    fresh.offset = n
    return fresh


def restore(layers: Cache, n: int) -> Cache:
    """A cache holding the first ``n`` positions of a snapshot, for one job (no copy of
    the data: new array objects over the snapshot's; updates never reach the snapshot).
    ``n`` must be at least :func:`shortest`."""
    return [_fresh(c, n) for c in layers]


def count(model: Any) -> int:
    """How many caches ``model`` takes (not always one per layer: an MLP-only layer of a
    hybrid has none), so a combined cache (target's, then draft's) splits after it."""
    return len(make_prompt_cache(model))


def nbytes(cache: Cache) -> int:
    return sum(int(c.nbytes) for c in leaves(cache))
