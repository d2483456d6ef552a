"""Measuring memory: a model's KV bytes per sequence, and the device's memory.

A model's KV bytes are measured, not derived from its config: one token goes
through the model with the cache mlx-lm makes for it (``make_prompt_cache``),
and every layer's cache is read as it is. Full-attention layers cost bytes per
token; sliding-window layers (``RotatingKVCache``) the same up to their window;
recurrent layers (``ArraysCache``) a fixed state per sequence; quantized or
latent (MLA) caches whatever their arrays hold. So grouped-query heads, head
sizes, dtypes and hybrid layouts are counted as they are, for any model mlx-lm
loads.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

#: Share of the device's memory mlxq plans with when no ``--cache-gb`` budget is set.
DEVICE_SHARE = 0.8


@dataclass(frozen=True)
class KVProfile:
    """Bytes of KV cache one sequence of a model needs, as a function of its length."""

    per_token: int  # full-attention layers
    windows: tuple[tuple[int, int], ...] = ()  # sliding-window layers: (window, bytes/token)
    fixed: int = 0  # per sequence, whatever its length (recurrent state)

    def bytes_for(self, tokens: int) -> int:
        windowed = sum(per * min(tokens, window) for window, per in self.windows)
        return self.per_token * tokens + windowed + self.fixed


def _arrays_bytes(value: Any) -> int:
    return sum(a.nbytes for _, a in tree_flatten(value) if isinstance(a, mx.array))


def _layer_caches(caches: Iterable[Any]) -> Iterable[Any]:
    for c in caches:
        inner = getattr(c, "caches", None)  # CacheList: several caches in one layer
        if isinstance(inner, (list, tuple)):
            yield from _layer_caches(inner)
        else:
            yield c


def kv_profile(model: nn.Module, cache: list[Any] | None = None) -> KVProfile:
    """Measure ``model``'s KV bytes per sequence (one forward pass of one token into
    ``cache``, an empty one as the engines make them; mlx-lm's own when None)."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model) if cache is None else cache
    model(mx.array([[0]]), cache=cache)
    per_token, fixed, windows = 0, 0, []
    for c in _layer_caches(cache):
        keys = getattr(c, "keys", None)
        if keys is None:  # recurrent state (or nothing): a fixed cost per sequence
            fixed += _arrays_bytes(getattr(c, "state", None))
            continue
        first = tree_flatten(keys)[0][1] if not isinstance(keys, mx.array) else keys
        allocated = first.shape[-2]  # tokens the buffers have room for
        per = math.ceil((_arrays_bytes(keys) + _arrays_bytes(c.values)) / max(allocated, 1))
        window = getattr(c, "max_size", None)
        if window:
            windows.append((int(window), per))
        else:
            per_token += per
    return KVProfile(per_token, tuple(windows), fixed)


def device_memory() -> int:
    """Bytes the device can give MLX: the GPU's recommended working set (Apple
    silicon), else the machine's physical memory."""
    try:
        if mx.metal.is_available():
            return int(mx.device_info()["max_recommended_working_set_size"])
    except (AttributeError, KeyError):
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def default_budget() -> int:
    """What a worker without ``--cache-gb`` plans with: a share of :func:`device_memory`."""
    return int(DEVICE_SHARE * device_memory())


@contextmanager
def wired_limit() -> Iterator[None]:
    """Metal's wired-memory limit at the device's recommended working set while a worker
    serves, so no engine's weights or caches are paged out (mlx-lm sets it only inside
    ``stream_generate`` and for a ``BatchGenerator``'s life). A no-op off Metal."""
    from mlx_lm.utils import maybe_set_recommended_wired_limit

    old = maybe_set_recommended_wired_limit() if mx.metal.is_available() else None
    try:
        yield
    finally:
        if old is not None:
            mx.synchronize()
            mx.set_wired_limit(old)
