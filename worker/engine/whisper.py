"""Whisper windows decoded together: one encoder pass for the windows that join, then one
decoder step for every row at once (a continuous batch, as chat jobs have).

Each row is one 30 s window of one recording, asked for by ``worker.engine.transcript``
with its own prompt (the recording's previous text) and temperature. A row joining is
prefilled alone, through mlx-whisper's own decoder call, so its first token, its
no-speech probability and its cache are mlx-whisper's; its self-attention cache and the
keys and values of its audio then sit in one slot of per-layer buffers, and each step
runs every row's next token through the decoder's own layers with a mask per row (rows
differ in length). The logit rules are mlx-whisper's (suppressed tokens, timestamp pairs
and order). Greedy text equals mlx-whisper's ``decode`` of the window alone (tested);
at a temperature above 0 a row samples with its own key, not MLX's global generator.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np


@dataclass(frozen=True)
class Window:
    """One decode a recording asks for: its mel window (3,000 frames, the model's dtype),
    the decoding options (mlx-whisper's ``DecodingOptions``) and a sampling key."""

    mel: mx.array
    options: Any
    seed: int = 0
    #: The encoder's output for ``mel`` when already computed (a retry at another
    #: temperature decodes the same window again).
    features: mx.array | None = None


@dataclass
class Decoded:
    """A window's result, as mlx-whisper's ``DecodingResult`` holds it."""

    tokens: list[int]
    text: str
    avg_logprob: float
    no_speech_prob: float
    temperature: float
    compression_ratio: float
    features: mx.array


@dataclass
class _Row:
    owner: Any
    window: Window
    task: Any  # mlx-whisper's DecodingTask: initial tokens, filters, tokenizer
    features: mx.array
    tokens: list[int]
    sum_logprob: np.float32
    no_speech: float
    key: mx.array
    sampled: int = 0
    suppress: mx.array | None = field(default=None, repr=False)
    #: Its timestamp rule (mlx-whisper's ``ApplyTimestampRules``; None: no timestamps).
    rule: Any = None
    #: The prefill's caches, until :meth:`WhisperBatch._place` lays them in a slot.
    kv: Any = field(default=None, repr=False)


def load_whisper(path: Path, dtype: mx.Dtype = mx.float16) -> nn.Module:
    """A Whisper checkpoint in mlx-whisper's format (``config.json`` with ``n_mels`` and
    ``weights.safetensors`` / ``weights.npz``), through mlx-whisper's own loader."""
    try:
        from mlx_whisper.load_models import load_model
    except ImportError as e:
        raise ImportError(f"audio jobs need mlx-whisper (pip install 'mlxq[audio]'): {e}") from e
    return load_model(str(path), dtype=dtype)


def whisper_dtype() -> mx.Dtype:
    """float16 on a GPU (mlx-whisper's default); float32 on the CPU, whose float16 matrix
    products are several times slower (measured here: the encoder 0.70 s vs 0.18 s a window)."""
    return mx.float16 if mx.default_device() == mx.gpu else mx.float32


def is_whisper(config: dict[str, Any]) -> bool:
    """Whether a model directory's config is a Whisper checkpoint in mlx-whisper's format."""
    return "n_audio_ctx" in config and "n_text_ctx" in config


def row_bytes(model: nn.Module) -> int:
    """Bytes one row holds: its self-attention cache (the text context) and its audio's keys
    and values, in every decoder layer."""
    d = model.dims
    # (float16 weights under float32 audio make float32 activations)
    itemsize = max(model.decoder.token_embedding.weight.dtype.size, whisper_dtype().size)
    return 2 * d.n_text_layer * d.n_text_state * (d.n_text_ctx + d.n_audio_ctx) * itemsize


class WhisperBatch:
    """Rows of windows decoded together, at most ``capacity`` at once."""

    def __init__(self, model: nn.Module, capacity: int, dtype: mx.Dtype | None = None) -> None:
        self.model, self.capacity = model, capacity
        # the dtype the model was loaded with (mlx-whisper makes its causal mask in it)
        self.mask_dtype = dtype or whisper_dtype()
        self.n_ctx = model.dims.n_text_ctx
        # Per layer, made when the first row joins, in the dtype its prefill made (a
        # checkpoint's float16 weights under float32 audio give float32 from the first
        # cross-attention on): self-attention keys and values, and the audio's keys and
        # values as attention reads them (heads apart, keys scaled and turned), laid out
        # once when a row joins, not at every step.
        self.keys: list[mx.array] = []
        self.values: list[mx.array] = []
        self.cross_keys: list[mx.array] = []
        self.cross_values: list[mx.array] = []
        self.rows: list[_Row] = []  # row i sits in slot i

    def _buffers(self, kv: list[Any]) -> None:
        d, cap = self.model.dims, self.capacity
        for (k, v), (ck, cv) in kv:
            heads, state = d.n_text_head, k.shape[-1]
            self.keys.append(mx.zeros((cap, self.n_ctx, state), k.dtype))
            self.values.append(mx.zeros((cap, self.n_ctx, state), v.dtype))
            per_head = state // heads
            self.cross_keys.append(mx.zeros((cap, heads, per_head, ck.shape[1]), ck.dtype))
            self.cross_values.append(mx.zeros((cap, heads, ck.shape[1], per_head), cv.dtype))

    @property
    def room(self) -> int:
        return self.capacity - len(self.rows)

    def add(self, asked: list[tuple[Any, Window]]) -> list[tuple[Any, Decoded]]:
        """Take windows in (at most :attr:`room`): one encoder pass for those not encoded,
        each prefilled alone. Returns those already done after their first token."""
        assert len(asked) <= self.room
        fresh = [i for i, (_, w) in enumerate(asked) if w.features is None]
        encoded: dict[int, mx.array] = {}
        if fresh:
            mels = mx.stack([asked[i][1].mel for i in fresh])
            features = self.model.encoder(mels)
            mx.eval(features)
            encoded = {i: features[n : n + 1] for n, i in enumerate(fresh)}
        done = []
        for i, (owner, window) in enumerate(asked):
            features = encoded.get(i, window.features)
            assert features is not None
            row = self._prefill(owner, window, features)
            if self._ended(row):
                done.append((owner, self._result(row)))
            else:
                self._place(row)
        return done

    def _prefill(self, owner: Any, window: Window, features: mx.array) -> _Row:
        from mlx_whisper.decoding import DecodingTask

        task = DecodingTask(self.model, window.options)
        tokens = list(task.initial_tokens)
        inputs = mx.array([tokens])
        logits, kv, _ = self.model.decoder(inputs, features, kv_cache=None)
        pre = logits.astype(mx.float32)
        no_speech = float("nan")
        if task.tokenizer.no_speech is not None:
            probs = mx.softmax(pre[:, task.sot_index], axis=-1)
            no_speech = probs[0, task.tokenizer.no_speech].item()
        last = pre[:, -1]
        for rule in task.logit_filters:
            last = rule.apply(last, inputs)
        row = _Row(
            owner,
            window,
            task,
            features,
            tokens,
            np.float32(0.0),
            no_speech,
            mx.random.key(window.seed),
            rule=_timestamps(task),
            kv=kv,
        )
        self._choose([row], last)
        return row

    def _place(self, row: _Row) -> None:
        if not self.keys:
            self._buffers(row.kv)
        slot = len(self.rows)
        for e, ((k, v), (ck, cv)) in enumerate(row.kv):
            n = k.shape[1]
            self.keys[e][slot, :n] = k[0]
            self.values[e][slot, :n] = v[0]
            heads = self.model.decoder.blocks[e].cross_attn.n_head
            self.cross_keys[e][slot] = _heads(ck, heads, keys=True)[0]
            self.cross_values[e][slot] = _heads(cv, heads, keys=False)[0]
        row.kv = None
        suppress = [f for f in row.task.logit_filters if hasattr(f, "mask")]
        row.suppress = suppress[-1].mask if suppress else None
        self.rows.append(row)

    def step(self) -> list[tuple[Any, Decoded]]:
        """One token for every row; returns the rows that ended, with their results."""
        if not self.rows:
            return []
        logits = self._forward()
        rules = [r.suppress for r in self.rows]
        if all(m is not None for m in rules):
            logits = logits + mx.stack(rules)  # type: ignore[arg-type]
        logits = timestamp_rules(logits, self.rows)
        self._choose(self.rows, logits)
        ended = [i for i, r in enumerate(self.rows) if self._ended(r)]
        out = [(self.rows[i].owner, self._result(self.rows[i])) for i in ended]
        for i in reversed(ended):
            self._remove(i)
        return out

    def drop(self, owner: Any) -> None:
        """Remove ``owner``'s rows (its job stopped)."""
        for i in reversed(range(len(self.rows))):
            if self.rows[i].owner is owner:
                self._remove(i)

    def _remove(self, i: int) -> None:
        last = len(self.rows) - 1
        if i != last:  # the last row moves into the freed slot: rows stay packed
            n = len(self.rows[last].tokens)
            for buffers in (self.keys, self.values):
                for e, b in enumerate(buffers):
                    buffers[e][i, :n] = b[last, :n]
            for buffers in (self.cross_keys, self.cross_values):
                for e, b in enumerate(buffers):
                    buffers[e][i] = b[last]
            self.rows[i] = self.rows[last]
        self.rows.pop()

    def _forward(self) -> mx.array:
        """The decoder's layers over every row's last token at its own position."""
        dec = self.model.decoder
        n = len(self.rows)
        positions = [len(r.tokens) - 1 for r in self.rows]
        span = max(positions) + 1
        pos = mx.array(positions)
        x = dec.token_embedding(mx.array([[r.tokens[-1]] for r in self.rows]))
        x = x + dec.positional_embedding[pos][:, None, :]
        allowed = mx.arange(span)[None, :] <= pos[:, None]
        # in the causal mask's dtype, as mlx-whisper adds it (a float32 mask lifts float16
        # scores to float32 before the softmax)
        mask = mx.where(allowed, 0.0, -mx.inf).astype(self.mask_dtype)[:, None, None, :]
        rows = mx.arange(n)
        for e, block in enumerate(dec.blocks):
            h = block.attn_ln(x)
            q, k, v = block.attn.query(h), block.attn.key(h), block.attn.value(h)
            self.keys[e][rows, pos] = k[:, 0]
            self.values[e][rows, pos] = v[:, 0]
            keys = mx.contiguous(self.keys[e][:n, :span])  # (as a fresh concatenation is)
            values = mx.contiguous(self.values[e][:n, :span])
            x = x + block.attn.out(_attention(block.attn.n_head, q, keys, values, mask))
            h = block.cross_attn_ln(x)
            q = block.cross_attn.query(h)
            ck, cv = self.cross_keys[e][:n], self.cross_values[e][:n]
            x = x + block.cross_attn.out(_cross(block.cross_attn.n_head, q, ck, cv))
            x = x + block.mlp2(nn.gelu(block.mlp1(block.mlp_ln(x))))
        x = dec.ln(x)
        return dec.token_embedding.as_linear(x)[:, -1].astype(mx.float32)

    def _choose(self, rows: list[_Row], logits: mx.array) -> None:
        """Each row's next token (greedy at temperature 0, else sampled with its own key),
        its log probability added as mlx-whisper adds it."""
        chosen = logits.argmax(axis=-1)
        hot = [i for i, r in enumerate(rows) if r.window.options.temperature > 0]
        if hot:
            picks = chosen.tolist()
            for i in hot:
                row = rows[i]
                row.key, sub = mx.random.split(row.key)
                t = row.window.options.temperature
                picks[i] = mx.random.categorical(logits[i] / t, key=sub).item()
            chosen = mx.array(picks)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        picked = logprobs[mx.arange(len(rows)), chosen]
        mx.eval(chosen, picked)
        for row, token, lp in zip(rows, chosen.tolist(), np.array(picked), strict=True):
            row.sum_logprob = np.float32(row.sum_logprob + np.float32(lp))
            row.tokens.append(int(token))
            row.sampled += 1

    def _ended(self, row: _Row) -> bool:
        task = row.task
        return (
            row.tokens[-1] == task.tokenizer.eot
            or row.sampled >= task.sample_len
            or len(row.tokens) > self.n_ctx
        )

    def _result(self, row: _Row) -> Decoded:
        from mlx_whisper.decoding import compression_ratio

        task = row.task
        eot = task.tokenizer.eot
        tokens = row.tokens[task.sample_begin :]
        if eot in tokens:
            tokens = tokens[: tokens.index(eot)]
        text = task.tokenizer.decode(tokens).strip()
        return Decoded(
            tokens=tokens,
            text=text,
            avg_logprob=float(row.sum_logprob) / (len(tokens) + 1),
            no_speech_prob=row.no_speech,
            temperature=row.window.options.temperature,
            compression_ratio=compression_ratio(text),
            features=row.features,
        )


def _attention(
    heads: int, q: mx.array, k: mx.array, v: mx.array, mask: mx.array | None
) -> mx.array:
    """mlx-whisper's ``qkv_attention``, with a mask per row."""
    n_batch, n_ctx, n_state = q.shape
    scale = (n_state // heads) ** -0.25
    q = q.reshape(*q.shape[:2], heads, -1).transpose(0, 2, 1, 3) * scale
    k = k.reshape(*k.shape[:2], heads, -1).transpose(0, 2, 3, 1) * scale
    v = v.reshape(*v.shape[:2], heads, -1).transpose(0, 2, 1, 3)
    qk = q @ k
    if mask is not None:
        qk = qk + mask
    w = mx.softmax(qk, axis=-1, precise=True)
    out = (w @ v).transpose(0, 2, 1, 3)
    return out.reshape(n_batch, n_ctx, n_state)


def _heads(x: mx.array, heads: int, keys: bool) -> mx.array:
    """Keys or values split by head as ``qkv_attention`` splits them (keys scaled)."""
    scale = (x.shape[-1] // heads) ** -0.25
    x = x.reshape(*x.shape[:2], heads, -1)
    return x.transpose(0, 2, 3, 1) * scale if keys else x.transpose(0, 2, 1, 3)


def _cross(heads: int, q: mx.array, k: mx.array, v: mx.array) -> mx.array:
    """:func:`_attention` over keys and values already split by :func:`_heads`."""
    n_batch, n_ctx, n_state = q.shape
    scale = (n_state // heads) ** -0.25
    q = q.reshape(*q.shape[:2], heads, -1).transpose(0, 2, 1, 3) * scale
    w = mx.softmax(q @ k, axis=-1, precise=True)
    out = (w @ v).transpose(0, 2, 1, 3)
    return out.reshape(n_batch, n_ctx, n_state)


def timestamp_rules(logits: mx.array, rows: list[_Row]) -> mx.array:
    """mlx-whisper's ``ApplyTimestampRules`` after a row's first token, for rows that each
    began sampling at their own position (a row without timestamps is left as it is): the
    same logits, with the same entries ruled out (``-inf``), built as spans per row rather
    than a dense mask."""
    n, vocab = logits.shape
    spans = np.zeros((n, 4), np.int32)  # two [lo, hi) spans ruled out per row
    single = np.full((n, 1), -1, np.int32)  # <|notimestamps|>
    timed = np.zeros((n, 1), bool)
    begin = None
    for k, row in enumerate(rows):
        rule = row.rule
        if rule is None:
            continue
        tok = rule.tokenizer
        begin = tok.timestamp_begin
        timed[k] = True
        if tok.no_timestamps is not None:
            single[k] = tok.no_timestamps
        seq = row.tokens[rule.sample_begin :]
        last_was = len(seq) >= 1 and seq[-1] >= begin
        penultimate_was = len(seq) < 2 or seq[-2] >= begin
        if last_was:  # timestamps come in pairs, except right before the end
            spans[k, :2] = (begin, vocab) if penultimate_was else (0, tok.eot)
        # (mlx-whisper counts positions here, not timestamp values: kept as it is)
        stamps = [i for i, v in enumerate(seq) if v > begin]
        if stamps:
            last = stamps[-1]
            if not last or penultimate_was:
                last += 1
            spans[k, 2:] = (begin, last)
    if begin is None:
        return logits
    col = mx.arange(vocab)[None, :]
    at = mx.array(spans)
    out = ((col >= at[:, 0:1]) & (col < at[:, 1:2])) | ((col >= at[:, 2:3]) & (col < at[:, 3:4]))
    out = out | (col == mx.array(single))
    forced = mx.array(_forced(logits, begin) & timed)
    out = out | (forced & (col < begin))
    return mx.where(out, -mx.inf, logits)


def _forced(logits: mx.array, begin: int) -> np.ndarray:
    """Rows whose timestamps together are likelier than any text token (then a timestamp
    must come), decided as mlx-whisper decides it: on log probabilities, which need the
    whole vocabulary's log-sum-exp. That sum is taken only for rows whose margin is too
    thin to decide without it (a clear margin decides the same: subtracting one number
    from both sides cannot reverse a gap of more than a few ulps)."""
    stamps = mx.logsumexp(logits[:, begin:], axis=-1)
    text = logits[:, :begin].max(axis=-1)
    mx.eval(stamps, text)
    a, b = np.array(stamps), np.array(text)
    gap = a - b
    forced = gap > 0
    thin = np.nonzero(~(np.abs(gap) > 1e-3 * (2.0 + np.abs(a) + np.abs(b))))[0]
    if thin.size:  # exactly as mlx-whisper: (a - lse) > (b - lse)
        rows = logits[mx.array(thin)]
        logprobs = rows - mx.logsumexp(rows, axis=-1, keepdims=True)
        exact = logprobs[:, begin:].logsumexp(axis=-1) > logprobs[:, :begin].max(axis=-1)
        forced[thin] = np.array(exact)
    return forced[:, None]


def _timestamps(task: Any) -> Any:
    from mlx_whisper.decoding import ApplyTimestampRules

    found = [f for f in task.logit_filters if isinstance(f, ApplyTimestampRules)]
    return found[0] if found else None
