"""The pre-tokenizers of byte-level BPE vocabularies, by the name a GGUF file gives them.

``tokenizer.ggml.pre`` names how text is split into words before BPE merges them: a
sequence of regexes, each splitting the pieces the previous one left (a match is a
piece, and so is the text between matches), as llama.cpp's ``llama-vocab.cpp`` does
for each name. Where llama.cpp rewrites a regex for its own regex engine, the original
from the model's ``tokenizer.json`` is used here (the ``tokenizers`` package runs it).
``ignore_merges``: a word that is a token as a whole is that token (Llama 3, Tekken).
"""

from __future__ import annotations

from dataclasses import dataclass

_CONTRACTIONS = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)"
GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
LLAMA3 = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2 = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_UPPER, _LOWER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]", r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"
GPT4O = (
    rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+{_CONTRACTIONS}?"
    rf"|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*{_CONTRACTIONS}?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
TEKKEN = (
    rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_CJK = "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+"  # CJK and Hangul, as llama.cpp
DEEPSEEK_CODER = (r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _CJK, r"\p{N}")
DEEPSEEK_V3 = (
    r"\p{N}{1,3}",
    "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",  # CJK, Hiragana, Katakana
    r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
    r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
)
#: llama.cpp's split for a file that names no pre-tokenizer, or "default".
DEFAULT = (r"[\p{P}\$\+<=>\^~\|]+", GPT2, r"\p{N}+", r"[0-9][0-9][0-9]")


@dataclass(frozen=True)
class PreTokenizer:
    """How a vocabulary splits text before BPE."""

    regexes: tuple[str, ...]
    ignore_merges: bool = False


def _names(names: str, pre: PreTokenizer) -> dict[str, PreTokenizer]:
    return dict.fromkeys(names.split(), pre)


#: Every ``tokenizer.ggml.pre`` this importer builds, grouped as llama.cpp groups them.
PRE_TOKENIZERS: dict[str, PreTokenizer] = {
    **_names("default", PreTokenizer(DEFAULT)),
    **_names(
        "gpt2 gpt-2 phi-2 mpt olmo jais trillion granite-docling exaone4 gigachat a.x-4.0 "
        "mellum jina-es jina-de jina-v2-es jina-v2-de",
        PreTokenizer((GPT2,)),
    ),
    **_names(
        "llama3 llama-v3 llama-bpe falcon3 falcon-h1 pixtral midm-2.0 lfm2",
        PreTokenizer((LLAMA3,), ignore_merges=True),
    ),
    **_names("dbrx smaug-bpe", PreTokenizer((LLAMA3,))),
    **_names(
        "qwen2 deepseek-r1-qwen kormo f2llmv2 megrez stablelm2 hunyuan solar-open",
        PreTokenizer((QWEN2,)),
    ),
    **_names(
        "smollm starcoder refact command-r codeshell exaone minerva-7b mellum2",
        PreTokenizer((r"\p{N}", GPT2)),
    ),
    **_names("gpt-4o llama4 kanana2 talkie minimax-m2", PreTokenizer((GPT4O,))),
    **_names("tekken", PreTokenizer((TEKKEN,), ignore_merges=True)),
    **_names("deepseek-coder", PreTokenizer(DEEPSEEK_CODER)),
    **_names("deepseek-v3 hunyuan-dense joyai-llm", PreTokenizer(DEEPSEEK_V3)),
}


def pre_tokenizer(name: str) -> PreTokenizer | None:
    """The pre-tokenizer a GGUF file names; None for a name this importer does not know."""
    return PRE_TOKENIZERS.get(name)
