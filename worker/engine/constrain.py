"""Constrained decoding: a token mask at every step, so the output follows a grammar.

The grammar comes from the request (``schemas.structured``); here it meets the
model's tokenizer. A :class:`GrammarProcessor` is an mlx-lm logits processor, so
it works wherever mlx-lm calls processors: ``generate_step`` (one job),
``speculative_generate_step`` (the draft's proposals *and* the target's
verification are masked) and ``BatchGenerator`` (one processor per sequence: a
constrained job shares a batch with unconstrained ones).

The processor does not rely on being called once per token in order: each call
brings the matcher to the exact token history it is given (rolling back what
differs, consuming what is new). Speculative decoding calls it for hypothetical
continuations and rewinds; the matcher follows. After generation,
:func:`verify` replays the final tokens through a fresh matcher: output that
does not follow the grammar fails the job instead of being returned.
"""

from __future__ import annotations

import copy
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import llguidance
import mlx.core as mx
import numpy as np

from schemas import ChatRequest, GenerationError, InvalidRequestError

#: Compiled grammars kept per tokenizer (least recently used dropped first).
GRAMMARS_PER_TOKENIZER = 64

_lock = threading.Lock()
_tokenizers: weakref.WeakKeyDictionary[Any, _Compiled] = weakref.WeakKeyDictionary()
_SHIFTS = mx.arange(32, dtype=mx.uint32)


@dataclass(eq=False)
class _Compiled:
    """One tokenizer's llguidance view and its compiled grammars."""

    tokenizer: llguidance.LLTokenizer
    grammars: OrderedDict[str, llguidance.LLMatcher] = field(default_factory=OrderedDict)


@dataclass(frozen=True, eq=False)
class Constraint:
    """A grammar compiled for one tokenizer; :meth:`processor` per sequence."""

    tokenizer: llguidance.LLTokenizer
    grammar: str
    prototype: llguidance.LLMatcher  # compiled (its first mask computed); copied per sequence
    # Token ids that switch the grammar on (a tool call's opening marker under
    # tool_choice auto): text before them is free; () : the grammar holds from the start.
    trigger: tuple[int, ...] = ()

    def governed(self, completion: list[int]) -> list[int] | None:
        """The part of ``completion`` the grammar governs; None while it is free text."""
        if not self.trigger:
            return completion
        at = find_run(completion, self.trigger)
        return None if at < 0 else completion[at + len(self.trigger) :]

    def matcher(self) -> llguidance.LLMatcher:
        return self.prototype.deep_copy()

    def processor(self) -> GrammarProcessor:
        return GrammarProcessor(self)

    @property
    def eos(self) -> frozenset[int]:
        return frozenset(self.tokenizer.eos_tokens)


def find_run(tokens: list[int] | tuple[int, ...], run: tuple[int, ...]) -> int:
    """Where ``run`` first occurs in ``tokens`` (-1: nowhere); a C-speed scan for its first
    token (it runs on every decoding step of a job with a trigger)."""
    i, n = -1, len(run)
    while True:
        try:
            i = tokens.index(run[0], i + 1)
        except ValueError:
            return -1
        if tuple(tokens[i : i + n]) == run:
            return i


def constraint_for(
    request: ChatRequest,
    tokenizer: Any,
    vocab_size: int,
    forced_call: str | None = None,
    trigger: tuple[int, ...] = (),
) -> Constraint | None:
    """The request's ``response_format`` (or ``forced_call``: the grammar of its tool
    calls, ``worker.engine.toolcalls``, from the ``trigger`` tokens on when given)
    compiled for ``tokenizer`` (an mlx-lm ``TokenizerWrapper``); None for free text.
    Cached per (grammar, tokenizer)."""
    grammar = forced_call or request.grammar
    if grammar is None:
        return None
    what = "the required tool call" if forced_call else "the constrained output"
    with _lock:
        compiled = _compiled(tokenizer, vocab_size)
        proto = compiled.grammars.get(grammar)
        if proto is not None:
            compiled.grammars.move_to_end(grammar)
        else:
            proto = llguidance.LLMatcher(compiled.tokenizer, grammar, log_level=0)
            proto.compute_bitmask()  # llguidance compiles lazily: do it once, here
            if proto.is_error():
                raise InvalidRequestError(
                    f"{what} cannot be enforced with this model's tokenizer: "
                    f"{proto.get_error().splitlines()[0]}"
                )
            compiled.grammars[grammar] = proto
            while len(compiled.grammars) > GRAMMARS_PER_TOKENIZER:
                compiled.grammars.popitem(last=False)
        return Constraint(compiled.tokenizer, grammar, proto, trigger)


def _compiled(tokenizer: Any, vocab_size: int) -> _Compiled:
    """The tokenizer's llguidance view (built once per tokenizer, ~0.2 s for 32k tokens)."""
    compiled = _tokenizers.get(tokenizer)
    if compiled is None:
        compiled = _Compiled(_lltokenizer(tokenizer, vocab_size))
        _tokenizers[tokenizer] = compiled
    return compiled


def token_bytes(tokenizer: Any, vocab_size: int) -> Callable[[int], bytes]:
    """Each token's exact bytes (a piece of a UTF-8 character stays a piece); special
    tokens as their text."""
    with _lock:
        ll = _compiled(tokenizer, vocab_size).tokenizer

    def of(token: int) -> bytes:
        if ll.is_special_token(token):
            return str(tokenizer.convert_ids_to_tokens(token)).encode()
        return ll.decode_bytes([token])

    return of


class GrammarProcessor:
    """An mlx-lm logits processor: logits of tokens the grammar forbids become -inf."""

    def __init__(self, constraint: Constraint) -> None:
        self.constraint = constraint
        self.matcher = constraint.matcher()
        self.offset: int | None = None  # tokens of the first call's history: all prompt
        self.seen: list[int] = []  # completion tokens the matcher has consumed
        words = (constraint.tokenizer.vocab_size + 31) // 32
        self.bits = np.zeros(words, dtype=np.int32)

    def __call__(self, tokens: mx.array | None, logits: mx.array) -> mx.array:
        history = tokens.reshape(-1) if tokens is not None else mx.array([], mx.uint32)
        if self.offset is None:  # mlx-lm calls processors first before any token is sampled
            self.offset = history.size
        completion = history[self.offset :].tolist() if history.size > self.offset else []
        governed = self.constraint.governed(completion)
        if governed is None:
            return logits  # free text until the trigger
        if not self._follow(governed):
            return logits  # a continuation past the end (after EOS): never emitted
        self.matcher.unsafe_compute_mask_ptr(self.bits.ctypes.data, self.bits.nbytes)
        if self.matcher.is_error():
            # E.g. a grammar past llguidance's limits: only EOS is left, and verify() fails
            # the job (raising here would take every sequence of a batch down with it).
            self.bits[:] = 0
            words = self.bits.view(np.uint32)
            for t in self.constraint.eos:
                words[t // 32] |= np.uint32(1 << (t % 32))
        return mask_logits(logits, self.bits)

    def _follow(self, completion: list[int]) -> bool:
        """Bring the matcher to ``completion``; False if the grammar ended before it."""
        seen = self.seen
        same = 0
        limit = min(len(seen), len(completion))
        while same < limit and seen[same] == completion[same]:
            same += 1
        if same < len(seen):
            self.matcher.rollback(len(seen) - same)
            del seen[same:]
            if self.matcher.is_error():
                # llguidance can refuse a rollback across a special token and the
                # lexeme after it ("rollback: too many bytes"): start again from a
                # fresh copy and replay what is kept.
                self.matcher = self.constraint.matcher()
                took = self.matcher.try_consume_tokens(seen) if seen else 0
                if took != len(seen):
                    return False
        new = completion[same:]
        if new:
            took = self.matcher.try_consume_tokens(new)
            seen.extend(new[:took])
            return took == len(new)
        return True


def mask_logits(logits: mx.array, bits: np.ndarray) -> mx.array:
    """``logits`` (``[..., vocab]``) with every token whose bit is 0 set to -inf."""
    words = mx.array(bits.view(np.uint32))
    allowed = ((words[:, None] >> _SHIFTS) & 1).reshape(-1).astype(mx.bool_)
    width = logits.shape[-1]
    if allowed.size < width:
        allowed = mx.concatenate([allowed, mx.zeros((width - allowed.size,), mx.bool_)])
    return mx.where(allowed[:width], logits, mx.array(-mx.inf, logits.dtype))


def verify(constraint: Constraint, tokens: list[int] | tuple[int, ...], finish: str) -> None:
    """Replay the output through a fresh matcher; raise if it left the grammar.

    A "stop" output must be a complete match; a "length" one a prefix of one.
    """
    body = list(tokens)
    if body and body[-1] in constraint.eos:
        body.pop()
    governed = constraint.governed(body)
    if governed is None:
        return  # the trigger never came: free text
    body = governed
    matcher = constraint.matcher()
    took = matcher.try_consume_tokens(body)
    if took != len(body) or (finish == "stop" and not matcher.is_accepting()):
        raise GenerationError(
            f"constrained decoding produced output outside its grammar at token "
            f"{took} of {len(body)}"
        )


def _lltokenizer(tokenizer: Any, vocab_size: int) -> llguidance.LLTokenizer:
    """llguidance's view of an mlx-lm tokenizer: token bytes, EOS ids, vocabulary width.

    ``tokenizer`` is mlx-lm's ``TokenizerWrapper``, which hands the Hugging Face
    tokenizer's public attributes through; llguidance reads the Rust tokenizer's JSON
    (what ``llguidance.hf.from_tokenizer`` does with the wrapped object itself).
    """
    eos = sorted(int(t) for t in tokenizer.eos_token_ids)
    n_vocab = max(vocab_size, len(tokenizer))
    backend = copy.copy(tokenizer.backend_tokenizer)
    backend.no_padding()
    backend.no_truncation()
    try:
        return llguidance.LLTokenizer(backend.to_str(), n_vocab=n_vocab, eos_token=eos)
    except ValueError:  # a decoder llguidance does not classify (e.g. a bare Metaspace)
        wrapper = llguidance.TokenizerWrapper(_ByteTokens(tokenizer, n_vocab, eos[0]))
        return llguidance.LLTokenizer(wrapper, n_vocab=n_vocab, eos_token=eos)


class _ByteTokens:
    """Each token's bytes, found by decoding it after a plain anchor token (so a
    tokenizer's leading-space rules apply as they do mid-text)."""

    def __init__(self, hf: Any, n_vocab: int, eos: int) -> None:
        self.hf = hf
        self.eos_token_id = eos
        self.bos_token_id = hf.bos_token_id
        added = getattr(hf, "added_tokens_decoder", {})  # chat markers are often only here
        special_ids = {i for i, t in added.items() if getattr(t, "special", False)}
        self.special_token_ids = sorted(special_ids | set(hf.all_special_ids))
        anchor = hf.encode("a", add_special_tokens=False)
        base = hf.decode(anchor)
        self._anchor, self._base = anchor, base
        special = set(self.special_token_ids)
        tokens: list[bytes] = []
        for i in range(n_vocab):
            piece = hf.convert_ids_to_tokens(i) if i < len(hf) else None
            if piece is None:
                tokens.append(b"")
            elif i in special:  # llguidance's mark of a special token: never text
                tokens.append(b"\xff" + piece.encode())
            elif len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
                tokens.append(bytes([int(piece[3:5], 16)]))  # byte fallback
            else:
                text = hf.decode([*anchor, i])
                text = text[len(base) :] if text.startswith(base) else hf.decode([i])
                tokens.append(text.encode())
        self.tokens = tokens
        self._by_bytes: dict[bytes, int] | None = None  # built on first use
        self._widest = 1

    def __call__(self, text: str | bytes) -> list[int]:
        """``text`` as tokens mid-text (no leading space a tokenizer adds at the start).

        llguidance tokenizes what a grammar forces next (the ``rue`` of ``true``) and
        allows only its first token, so the tokens must spell exactly ``text``: the
        tokenizer's own split after the anchor when it does, else the longest tokens
        that do (a tokenizer that merges the anchor into the text, or puts its
        visible space before it, would otherwise force a token the grammar refuses)."""
        if isinstance(text, bytes):
            raise TypeError("text, not bytes")
        want = text.encode()
        ids = list(self.hf.encode(self._base + text, add_special_tokens=False))
        n = len(self._anchor)
        if ids[:n] == self._anchor and b"".join(self.tokens[i] for i in ids[n:]) == want:
            return ids[n:]
        return self._longest(want)

    def _longest(self, want: bytes) -> list[int]:
        if self._by_bytes is None:
            special = set(self.special_token_ids)
            self._by_bytes = {}
            for i, b in enumerate(self.tokens):
                if b and i not in special:
                    self._by_bytes.setdefault(b, i)
            self._widest = max(map(len, self._by_bytes), default=1)
        out, at = [], 0
        while at < len(want):
            for size in range(min(self._widest, len(want) - at), 0, -1):
                i = self._by_bytes.get(want[at : at + size])
                if i is not None:
                    out.append(i)
                    at += size
                    break
            else:  # a byte no token spells: llguidance treats it as untokenizable
                return out
        return out
