"""A GGUF file's vocabulary as a Hugging Face ``tokenizer.json`` (the ``tokenizers`` package).

Two GGUF tokenizer models, as llama.cpp names them:

- ``llama``: SentencePiece BPE (Gemma, Llama 2, Mistral). The file holds pieces, scores
  and token types but no merges; SentencePiece merges the adjacent pair whose joined
  piece scores highest, which is a BPE whose merge ranks follow the joined pieces'
  scores. Control tokens are special; user-defined ones (Gemma's newline and space
  runs) are matched whole before BPE, as SentencePiece does; unknown characters fall
  back to the ``<0xNN>`` byte pieces.
- ``gpt2``: byte-level BPE with merges (Llama 3, Qwen 2/3, SmolLM), split first by the
  regexes that ``tokenizer.ggml.pre`` names (``worker.gguf.pretok``, llama.cpp's list).

``tests/test_gguf.py`` checks the ``llama`` form against SentencePiece itself, run over
a model built from the same pieces, and against llama.cpp's own ids for sample text.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
)

from worker.gguf.pretok import PRE_TOKENIZERS, pre_tokenizer

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
SPACE = "\u2581"  # SentencePiece's visible space


class VocabError(ValueError):
    """The file's vocabulary is of a kind this importer does not build."""


@dataclass
class Vocab:
    """What a GGUF file says about its tokenizer (``tokenizer.ggml.*``)."""

    model: str
    tokens: list[str]
    types: list[int]
    scores: list[float] = field(default_factory=list)
    merges: list[str] = field(default_factory=list)
    pre: str = "default"
    bos_id: int | None = None
    eos_id: int | None = None
    unk_id: int | None = None
    pad_id: int | None = None
    add_bos: bool = False
    add_space_prefix: bool = False
    chat_template: str | None = None

    def token(self, i: int | None) -> str | None:
        return self.tokens[i] if i is not None and 0 <= i < len(self.tokens) else None


def spm_merges(vocab: Vocab) -> list[tuple[str, str]]:
    """SentencePiece BPE as merges: every split of a normal piece into two normal pieces,
    ranked by the joined piece's score (highest first), ties by the halves' ids."""
    ids = {p: i for i, p in enumerate(vocab.tokens) if vocab.types[i] == NORMAL}
    ranked: list[tuple[float, int, int, str, str]] = []
    for piece, i in ids.items():
        score = vocab.scores[i]
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            li, ri = ids.get(left), ids.get(right)
            if li is not None and ri is not None:
                ranked.append((-score, li, ri, left, right))
    ranked.sort()
    return [(left, right) for _, _, _, left, right in ranked]


def _spm(vocab: Vocab) -> Tokenizer:
    pieces = {p: i for i, p in enumerate(vocab.tokens)}
    if len(pieces) != len(vocab.tokens):
        raise VocabError("the vocabulary repeats pieces; a BPE needs each piece once")
    unk = vocab.token(vocab.unk_id)
    tok = Tokenizer(
        models.BPE(
            vocab=pieces, merges=spm_merges(vocab), unk_token=unk, fuse_unk=True, byte_fallback=True
        )
    )
    steps = [normalizers.Prepend(SPACE)] if vocab.add_space_prefix else []
    tok.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", SPACE)])
    tok.pre_tokenizer = None
    dec = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if vocab.add_space_prefix:
        dec.append(decoders.Strip(" ", 1, 0))
    tok.decoder = decoders.Sequence(dec)
    return tok


def _gpt2(vocab: Vocab) -> Tokenizer:
    pre = pre_tokenizer(vocab.pre)
    if pre is None:
        raise VocabError(
            f"pre-tokenizer {vocab.pre!r} is not one this importer knows; it knows "
            f"{len(PRE_TOKENIZERS)} of llama.cpp's: {', '.join(sorted(PRE_TOKENIZERS))}"
        )
    merges = [tuple(m.split(" ", 1)) for m in vocab.merges]
    tok = Tokenizer(
        models.BPE(
            vocab={p: i for i, p in enumerate(vocab.tokens)},
            merges=merges,  # type: ignore[arg-type]
            unk_token=vocab.token(vocab.unk_id),
            ignore_merges=pre.ignore_merges,
        )
    )
    splits = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in pre.regexes]
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    tok.decoder = decoders.ByteLevel()
    return tok


def build(vocab: Vocab) -> Tokenizer:
    """The ``tokenizers.Tokenizer`` that splits text as the GGUF's own tokenizer does."""
    if vocab.model == "llama":
        tok = _spm(vocab)
    elif vocab.model == "gpt2":
        tok = _gpt2(vocab)
    else:
        raise VocabError(f"tokenizer model {vocab.model!r} is not supported (llama, gpt2)")
    added = [
        AddedToken(
            vocab.tokens[i],
            special=t == CONTROL,
            normalized=False,
            single_word=False,
            lstrip=False,
            rstrip=False,
        )
        for i, t in enumerate(vocab.types)
        if t in (CONTROL, USER_DEFINED) or (t == UNUSED and vocab.model == "gpt2")
    ]
    tok.add_tokens(added)
    bos = vocab.token(vocab.bos_id)
    if vocab.add_bos and bos is not None and vocab.bos_id is not None:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos}:0 $A:0",
            pair=f"{bos}:0 $A:0 {bos}:1 $B:1",
            special_tokens=[(bos, vocab.bos_id)],
        )
    return tok


def save(vocab: Vocab, out: Path, chat_template: str | None) -> Tokenizer:
    """Write ``tokenizer.json``, ``tokenizer_config.json`` and ``special_tokens_map.json``."""
    tok = build(vocab)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    special = {
        name: piece
        for name, piece in (
            ("bos_token", vocab.token(vocab.bos_id)),
            ("eos_token", vocab.token(vocab.eos_id)),
            ("unk_token", vocab.token(vocab.unk_id)),
            ("pad_token", vocab.token(vocab.pad_id)),
        )
        if piece is not None
    }
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 1_000_000,
        "add_bos_token": vocab.add_bos,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        **special,
    }
    if chat_template:
        config["chat_template"] = chat_template
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    (out / "special_tokens_map.json").write_text(json.dumps(special, indent=1))
    return tok
