"""Quantized KV caches (``worker --kv-bits 8|4``), alone and in batches.

mlx-lm quantizes a sequence's KV cache (``QuantizedKVCache``: keys and values
kept as ``mx.quantize`` triples, attention by ``quantized_matmul``), but its
batched cache (``BatchKVCache``) holds plain arrays only, so its
``BatchGenerator`` cannot batch quantized sequences. Here:

- :class:`QuantizedKV`: mlx-lm's ``QuantizedKVCache`` that can also be merged
  into a batch (what ``BatchGenerator`` asks of a sequence's cache).
- :class:`BatchQuantizedKV`: mlx-lm's ``BatchKVCache`` (left padding, joins,
  leaves, trims, rolls) over quantized triples. Quantization groups run along
  each position's head dimension, so every positional operation (slice, pad,
  roll, concatenate) applies to the three arrays alike and never requantizes.
- :func:`make_cache`: a model's cache with every plain ``KVCache`` layer
  quantized. Sliding-window layers (mlx-lm quantizes no ``RotatingKVCache``) and
  recurrent state (``ArraysCache``) stay as they are: :func:`describe` says so.
- :func:`probe`: whether a model's attention takes quantized caches at all (an
  architecture that passes attention sinks, or calls the fused attention itself,
  does not): one short pass at load.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import mlx_lm.models.cache as mlx_cache
from mlx_lm.models.cache import (
    ArraysCache,
    BatchKVCache,
    CacheList,
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
    dynamic_roll,
    make_prompt_cache,
)

from worker.engine.rewind import leaves

Cache = list[Any]
Triple = tuple[mx.array, mx.array, mx.array]

#: What ``--kv-bits`` and ``--kv-group-size`` accept (what ``mx.quantize`` does exactly).
BITS = (4, 8)
GROUP_SIZES = (32, 64, 128)


#: The group size when none is given: 4 bits need finer groups (perplexity of held-out
#: prose, SmolLM2-135M: 1.20x unquantized at 64, 1.10x at 32; Gemma 3 270M: 1.08x, 1.05x).
DEFAULT_GROUP = {8: 64, 4: 32}


@dataclass(frozen=True)
class KVQuant:
    """How a worker quantizes KV caches."""

    bits: int
    group_size: int = 0  # 0: :data:`DEFAULT_GROUP` for the bits

    def __post_init__(self) -> None:
        if self.group_size == 0 and self.bits in DEFAULT_GROUP:
            object.__setattr__(self, "group_size", DEFAULT_GROUP[self.bits])
        if self.bits not in BITS:
            raise ValueError(f"--kv-bits must be one of {BITS}, not {self.bits}")
        if self.group_size not in GROUP_SIZES:
            raise ValueError(f"--kv-group-size must be one of {GROUP_SIZES}, not {self.group_size}")

    @property
    def tag(self) -> str:
        """A short name, part of a disk prefix's identity: "kv8g64"."""
        return f"kv{self.bits}g{self.group_size}"


def _each(triple: Triple, f: Any) -> Triple:
    a, b, c = (f(x) for x in triple)
    return a, b, c


def _cat(first: Triple, second: Triple, axis: int = 0) -> Triple:
    a, b, c = (mx.concatenate([x, y], axis) for x, y in zip(first, second, strict=True))
    return a, b, c


def _no_positions(like: Triple, rows: int, n: int = 0) -> Triple:
    """Zeros shaped as ``like`` with ``rows`` rows and ``n`` positions."""
    return _each(like, lambda x: mx.zeros((rows, x.shape[1], n, x.shape[3]), x.dtype))


class _Attends:
    """Which attention a quantized layer gets. mlx-lm's attention takes its quantized path
    (``quantized_matmul`` on the packed keys) when the cache has a ``bits`` attribute. A
    pass of one token per row (decoding) takes it: it reads a quarter of the bytes. A pass
    of several (prefill, a speculative verify) gets the keys and values dequantized, for
    the fused attention, transiently and one layer at a time: mlx-lm's quantized path
    builds every query-key score (2.8x slower prefill here), and mlx-lm's own generate
    quantizes only after 5,000 tokens for that reason. What is kept is quantized either
    way, so the outputs are those of quantized caches."""

    quant_bits: int
    group_size: int
    _dense = False  # the last pass was of several tokens: ``bits`` hidden

    @property
    def bits(self) -> int:
        if self._dense:  # hasattr(cache, "bits") is False: mlx-lm runs the fused attention
            raise AttributeError("bits")
        return self.quant_bits

    @bits.setter
    def bits(self, value: int) -> None:
        self.quant_bits = value

    def _fetched(self, qk: Triple, qv: Triple, tokens: int, dtype: mx.Dtype) -> tuple[Any, Any]:
        self._dense = tokens > 1
        if not self._dense:
            return qk, qv
        g, b = self.group_size, self.quant_bits
        k, v = (mx.dequantize(*t, group_size=g, bits=b).astype(dtype) for t in (qk, qv))
        return k, v


class QuantizedKV(_Attends, QuantizedKVCache):
    """mlx-lm's ``QuantizedKVCache``, batchable: ``merge`` makes a :class:`BatchQuantizedKV`."""

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[Any, Any]:
        self._dense = False  # (mlx-lm's update reads ``bits``)
        qk, qv = super().update_and_fetch(keys, values)
        return self._fetched(qk, qv, keys.shape[2], keys.dtype)

    @property
    def state(self) -> tuple[Any, ...]:
        return self.keys, self.values, self.offset, self.group_size, self.quant_bits

    @state.setter
    def state(self, v: tuple[Any, ...]) -> None:
        self.keys, self.values, self.offset, self.group_size, self.quant_bits = v

    @classmethod
    def merge(cls, caches: list[Any]) -> BatchQuantizedKV:
        return BatchQuantizedKV.merge(caches)

    @property
    def nbytes(self) -> int:
        # (mlx-lm 0.32's fails on an empty cache: a sequence still waiting to prefill)
        if self.keys is None:
            return 0
        return sum(int(x.nbytes) for x in (*self.keys, *self.values))


class BatchQuantizedKV(_Attends, BatchKVCache):
    """mlx-lm's ``BatchKVCache`` with keys and values held quantized (triples of
    packed values, scales and biases per position). ``bits`` and ``group_size`` make
    mlx-lm's attention take the quantized path."""

    def __init__(self, left_padding: list[int], group_size: int = 64, bits: int = 8) -> None:
        super().__init__(left_padding)
        self.group_size, self.bits = group_size, bits

    def _empty(self, b: int, h: int, n: int, dim: int, dtype: mx.Dtype) -> Triple:
        packed = dim * self.quant_bits // 32
        groups = dim // self.group_size
        return (
            mx.zeros((b, h, n, packed), dtype=mx.uint32),
            mx.zeros((b, h, n, groups), dtype=dtype),
            mx.zeros((b, h, n, groups), dtype=dtype),
        )

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[Any, Any]:
        prev, n = self._idx, keys.shape[2]
        if self.keys is None or prev + n > self.keys[0].shape[2]:
            b, h, _, dk = keys.shape
            room = (self.step + n - 1) // self.step * self.step
            new_k = self._empty(b, h, room, dk, keys.dtype)
            new_v = self._empty(b, h, room, values.shape[3], keys.dtype)
            if self.keys is None:
                self.keys, self.values = new_k, new_v
            else:
                old_k = _each(self.keys, lambda x: x[..., :prev, :])
                old_v = _each(self.values, lambda x: x[..., :prev, :])
                self.keys, self.values = _cat(old_k, new_k, 2), _cat(old_v, new_v, 2)
        self.offset = self.offset + n
        self._idx += n
        qk = mx.quantize(keys, group_size=self.group_size, bits=self.quant_bits)
        qv = mx.quantize(values, group_size=self.group_size, bits=self.quant_bits)
        for i in range(3):
            self.keys[i][..., prev : self._idx, :] = qk[i]
            self.values[i][..., prev : self._idx, :] = qv[i]
        return self._fetched(*self.keys_and_values(), n, keys.dtype)

    def keys_and_values(self) -> tuple[Triple, Triple]:
        n = self._idx
        return (
            _each(self.keys, lambda x: x[..., :n, :]),
            _each(self.values, lambda x: x[..., :n, :]),
        )

    def finalize(self) -> None:
        if self._right_padding is not None:
            shift = self._right_padding[:, None]
            self.keys = _each(self.keys, lambda x: dynamic_roll(x, shift, axis=2))
            self.values = _each(self.values, lambda x: dynamic_roll(x, shift, axis=2))
            self.offset = self.offset - self._right_padding
            self.left_padding += self._right_padding
            self._right_padding = None

    def filter(self, batch_indices: Any) -> None:
        if self.keys is not None:
            self.keys = _each(self.keys, lambda x: x[batch_indices])
            self.values = _each(self.values, lambda x: x[batch_indices])
        self.offset = self.offset[batch_indices]
        self.left_padding = self.left_padding[batch_indices]
        drop = min(self.left_padding.tolist())
        if drop > 0:
            if self.keys is not None:
                self.keys = _each(self.keys, lambda x: x[..., drop:, :])
                self.values = _each(self.values, lambda x: x[..., drop:, :])
            self._idx -= drop
            self.left_padding -= drop

    def extend(self, other: BatchQuantizedKV) -> None:
        if self.keys is None and other.keys is None:
            self.left_padding = mx.concatenate([self.left_padding, other.left_padding])
            self.offset = mx.concatenate([self.offset, other.offset])
            return
        top = max(self._idx, other._idx)
        width = max(c.keys[0].shape[2] for c in (self, other) if c.keys is not None)
        ref = self if self.keys is not None else other
        b_k, b_v = ref.keys, ref.values

        def aligned(c: BatchQuantizedKV) -> tuple[Triple, Triple, mx.array, mx.array]:
            left = top - c._idx
            if c.keys is None:
                rows = c.offset.shape[0]
                k, v = _no_positions(b_k, rows), _no_positions(b_v, rows)
            else:
                k, v = c.keys, c.values
            right = width - k[0].shape[2] - left
            if right < 0:
                k = _each(k, lambda x: x[..., :right, :])
                v = _each(v, lambda x: x[..., :right, :])
                right = 0
            if left or right:
                pad = [(0, 0), (0, 0), (left, right), (0, 0)]
                k = _each(k, lambda x: mx.pad(x, pad))
                v = _each(v, lambda x: mx.pad(x, pad))
            return k, v, c.offset, c.left_padding + left

        (k1, v1, o1, p1), (k2, v2, o2, p2) = aligned(self), aligned(other)
        self.keys, self.values = _cat(k1, k2), _cat(v1, v2)
        self.offset = mx.concatenate([o1, o2])
        self.left_padding = mx.concatenate([p1, p2])
        self._idx = top

    def extract(self, idx: int) -> QuantizedKV:
        pad = int(self.left_padding[idx].item())
        out = QuantizedKV(self.group_size, self.quant_bits)
        out.keys = _each(self.keys, lambda x: mx.contiguous(x[idx : idx + 1, :, pad : self._idx]))
        out.values = _each(
            self.values, lambda x: mx.contiguous(x[idx : idx + 1, :, pad : self._idx])
        )
        out.offset = self._idx - pad
        return out

    @classmethod
    def merge(cls, caches: list[Any]) -> BatchQuantizedKV:
        first = caches[0]
        lengths = [c.offset if c.keys is not None else 0 for c in caches]
        top = max(lengths)
        padding = [top - n for n in lengths]
        out = cls(padding, first.group_size, first.quant_bits)
        if top == 0:
            return out
        held = [c for c in caches if c.keys is not None]

        def stacked(part: str) -> Triple:
            ref: Triple = getattr(held[0], part)
            rows = []
            for p, n, c in zip(padding, lengths, caches, strict=True):
                if n == 0:
                    rows.append(_no_positions(ref, 1, top))
                    continue
                own = _each(getattr(c, part), lambda x, n=n: x[..., :n, :])
                rows.append(_each(own, lambda x, p=p: mx.pad(x, [(0, 0), (0, 0), (p, 0), (0, 0)])))
            a, b, c = (mx.concatenate([r[i] for r in rows]) for i in range(3))
            return a, b, c

        out.keys, out.values = stacked("keys"), stacked("values")
        out.offset = out.offset + top
        out._idx = top
        return out

    def size(self) -> int:
        return self._idx

    def empty(self) -> bool:
        return self.keys is None

    @property
    def nbytes(self) -> int:
        if self.keys is None:
            return 0
        return sum(int(x.nbytes) for x in (*self.keys, *self.values))


# mlx-lm rebuilds caches by class name (``load_prompt_cache``, ``CacheList.state``):
# these names must be found in its module, as its own classes are.
mlx_cache.QuantizedKV = QuantizedKV  # type: ignore[attr-defined]
mlx_cache.BatchQuantizedKV = BatchQuantizedKV  # type: ignore[attr-defined]


def _quantized(c: Any, quant: KVQuant) -> Any:
    if type(c) is KVCache:
        return QuantizedKV(quant.group_size, quant.bits)
    if isinstance(c, CacheList):
        return CacheList(*(_quantized(p, quant) for p in c.caches))
    return c


def make_cache(model: nn.Module, quant: KVQuant | None = None) -> Cache:
    """``model``'s cache as mlx-lm makes it, with every plain KV layer quantized (when
    ``quant``); other layers as they are."""
    cache = make_prompt_cache(model)
    return cache if quant is None else [_quantized(c, quant) for c in cache]


def positions(c: Any) -> list[mx.array]:
    """The arrays of a batch layer that hold one entry per position (axis 2): its keys
    and values, or their quantized triples."""
    if isinstance(c.keys, tuple):
        return [*c.keys, *c.values]
    return [c.keys, c.values]


def describe(cache: Cache) -> str:
    """Which layers are quantized: "8-bit kv", or "8-bit kv, 16-bit sliding-window", ..."""
    ls = leaves(cache)
    parts = []
    quant = [c for c in ls if isinstance(c, QuantizedKV)]
    if quant:
        parts.append(f"{quant[0].quant_bits}-bit kv")
    if any(type(c) is KVCache for c in ls):
        parts.append("unquantized kv")
    if any(isinstance(c, RotatingKVCache) for c in ls):
        parts.append("unquantized sliding-window")
    if any(isinstance(c, ArraysCache) for c in ls):
        parts.append("recurrent state as is")
    return ", ".join(parts)


def probe(model: nn.Module, quant: KVQuant) -> str | None:
    """Why ``model`` cannot run on quantized KV caches, or None: it has no plain KV layer,
    or its attention fails on them (a pass of a few tokens, alone and as a batch)."""
    cache = make_cache(model, quant)
    if not any(isinstance(c, QuantizedKV) for c in leaves(cache)):
        return "it has no full-attention KV layer to quantize"
    try:
        out = model(mx.array([[1, 2, 3, 4]]), cache=cache)
        if all(hasattr(c, "merge") for c in cache):  # as a batch of one row
            out = out + model(mx.array([[5]]), cache=[c.merge([c]) for c in cache]).sum()
        mx.eval(out)
    except Exception as e:  # attention sinks, a fused kernel called directly, a head size
        return f"its attention does not take them ({type(e).__name__}: {e})"
    if not bool(mx.all(mx.isfinite(out)).item()):
        return "its output on them is not finite"
    return None
