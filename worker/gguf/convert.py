"""GGUF file -> mlx-lm model directory (config.json, safetensors, tokenizer files).

Weights are dequantized by llama.cpp's own reader (the ``gguf`` package, every GGML
type), renamed to mlx-lm's names and corrected for the family's conventions
(``families``); ``config.json`` comes from the file's metadata and the tokenizer from
its vocabulary (``vocab``). ``q_bits`` re-quantizes with mlx-lm afterwards.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from worker.gguf.families import Family, UnsupportedModel, family
from worker.gguf.templates import choose
from worker.gguf.vocab import Vocab, save

log = logging.getLogger(__name__)
DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}
SHARD_BYTES = 4 << 30


@dataclass(frozen=True)
class Imported:
    path: Path
    arch: str
    model_type: str
    tensors: int
    parameters: int
    chat_template: str  # "file", a family name, a path, or "none"
    seconds: float


def _reader(path: Path) -> Any:
    import gguf  # llama.cpp's reader: imported here, so the worker starts without it

    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such GGUF file")
    try:
        return gguf.GGUFReader(str(path))
    except Exception as e:  # the reader raises ValueError, struct.error, IndexError...
        raise UnsupportedModel(f"{path.name} is not a readable GGUF file ({e})") from e


def _field(reader: Any, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def read_vocab(reader: Any) -> Vocab:
    tokens = _field(reader, "tokenizer.ggml.tokens")
    if not tokens:
        raise UnsupportedModel("the file has no tokenizer (tokenizer.ggml.tokens)")
    n = len(tokens)
    return Vocab(
        model=_field(reader, "tokenizer.ggml.model", "llama"),
        tokens=list(tokens),
        types=[int(t) for t in _field(reader, "tokenizer.ggml.token_type", [1] * n)],
        scores=[float(s) for s in _field(reader, "tokenizer.ggml.scores", [0.0] * n)],
        merges=list(_field(reader, "tokenizer.ggml.merges", [])),
        pre=_field(reader, "tokenizer.ggml.pre", "default"),
        bos_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_id=_field(reader, "tokenizer.ggml.eos_token_id"),
        unk_id=_field(reader, "tokenizer.ggml.unknown_token_id"),
        pad_id=_field(reader, "tokenizer.ggml.padding_token_id"),
        add_bos=bool(_field(reader, "tokenizer.ggml.add_bos_token", False)),
        add_space_prefix=bool(_field(reader, "tokenizer.ggml.add_space_prefix", False)),
        chat_template=_field(reader, "tokenizer.chat_template"),
    )


def _weights(reader: Any, fam: Family, meta: Callable[[str, Any], Any]) -> dict[str, np.ndarray]:
    from gguf.quants import dequantize

    out: dict[str, np.ndarray] = {}
    for t in reader.tensors:
        if t.name == "rope_freqs.weight":
            raise UnsupportedModel("Llama 3.1-style RoPE scaling (rope_freqs) is not supported")
        name = fam.rename(t.name)
        array = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        out[name] = fam.convert(t.name, array, meta)
    return out


def _meta(reader: Any, arch: str) -> Callable[[str, Any], Any]:
    """The file's ``<arch>.<key>`` metadata by key."""
    return lambda key, default: _field(reader, f"{arch}.{key}", default)


def _config(reader: Any, fam: Family, vocab: Vocab, tied: bool) -> dict[str, Any]:
    config = fam.config(_meta(reader, fam.arch), len(vocab.tokens))
    eos = [vocab.eos_id] if vocab.eos_id is not None else []
    eos += [vocab.tokens.index(p) for p in fam.eos_pieces if p in vocab.tokens]
    return {
        "model_type": fam.model_type,
        **config,
        "tie_word_embeddings": tied,
        "bos_token_id": vocab.bos_id,
        "eos_token_id": eos[0] if len(eos) == 1 else eos,
        "gguf": {
            "name": _field(reader, "general.name"),
            "file_type": _field(reader, "general.file_type"),
        },
    }


def _save_weights(weights: dict[str, np.ndarray], out: Path, dtype: mx.Dtype) -> int:
    shards: list[dict[str, mx.array]] = [{}]
    size = 0
    for name in sorted(weights):
        a = mx.array(weights.pop(name)).astype(dtype)
        if size and size + a.nbytes > SHARD_BYTES:
            shards.append({})
            size = 0
        shards[-1][name] = a
        size += a.nbytes
    count = 0
    for i, shard in enumerate(shards):
        file = (
            "model.safetensors"
            if len(shards) == 1
            else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        )
        mx.save_safetensors(str(out / file), shard, metadata={"format": "mlx"})
        count += sum(a.size for a in shard.values())
    return count


def _quantize(out: Path, bits: int, group_size: int) -> None:
    from mlx_lm.utils import load_model, quantize_model, save_config, save_model

    model, config = load_model(out)
    model, config = quantize_model(model, config, group_size, bits)
    for f in out.glob("*.safetensors"):
        f.unlink()
    save_model(out, model)
    save_config(config, out / "config.json")


def requantize(src: Path, out: Path, bits: int, group_size: int = 64) -> Path:
    """A copy of the model directory ``src`` at ``out``, quantized by mlx-lm to ``bits``."""
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(src, tmp, ignore=shutil.ignore_patterns("mlxq-import.json"))
    _quantize(tmp, bits, group_size)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def import_gguf(
    path: Path,
    out: Path,
    *,
    dtype: str = "float32",
    q_bits: int | None = None,
    q_group_size: int = 64,
    chat_template: str | None = None,
    overwrite: bool = False,
) -> Imported:
    """Write an mlx-lm model directory at ``out`` from the GGUF file at ``path``.

    ``chat_template``: None keeps the file's own (none for a base model), a family name
    (``templates.FAMILY``) or a path to a Jinja file sets one, ``"none"`` drops it.
    """
    start = time.perf_counter()
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    if q_bits is not None and q_bits not in (2, 3, 4, 5, 6, 8):
        raise ValueError(f"q_bits {q_bits} is not one of 2, 3, 4, 5, 6, 8")
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise FileExistsError(f"{out} exists and is not empty (overwrite to replace it)")
    reader = _reader(path)
    fam = family(str(_field(reader, "general.architecture", "?")))
    vocab = read_vocab(reader)
    template, template_source = choose(chat_template, vocab.chat_template)
    tied = not any(t.name == "output.weight" for t in reader.tensors)
    config = _config(reader, fam, vocab, tied)
    weights = _weights(reader, fam, _meta(reader, fam.arch))
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save(vocab, tmp, template)
    (tmp / "config.json").write_text(json.dumps(config, indent=1))
    count = _save_weights(weights, tmp, DTYPES[dtype])
    if q_bits is not None:
        _quantize(tmp, q_bits, q_group_size)
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)  # whole or not at all: a killed import leaves only the .partial
    took = time.perf_counter() - start
    log.info(
        "imported %s (%s, %d parameters) to %s in %.1f s", path.name, fam.arch, count, out, took
    )
    return Imported(
        out, fam.arch, fam.model_type, len(reader.tensors), count, template_source, took
    )
