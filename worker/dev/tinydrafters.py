"""Tiny drafters for tests and benchmarks, built for a tiny target on disk.

A drafter checkpoint in the format mlx-vlm's ``load_drafter`` reads (config.json with
``model_type: eagle3``, or a ``dflash_config`` as z-lab's DFlash checkpoints have, and
safetensors), shaped for its target (hidden size, vocabulary, three of its layers
read), its weights random (acceptance near 0) until ``bench.drafters`` trains it on
the target's own continuations of given prompts; a Qwen3.5 checkpoint with an MTP
layer of its own. Deterministic per seed.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten


def eagle3_config(target: dict) -> dict:
    """An EAGLE-3 drafter's config.json for a target with config ``target``: it reads the
    target's first, middle and last layers."""
    n, h = int(target["num_hidden_layers"]), int(target["hidden_size"])
    reads = [0, n // 2, n - 1]
    heads = int(target.get("num_attention_heads", 4))
    return {
        "model_type": "eagle3",
        "speculators_model_type": "eagle3",
        "transformer_layer_config": {
            "model_type": "llama",
            "hidden_size": h,
            "intermediate_size": 2 * h,
            "num_hidden_layers": 1,
            "num_attention_heads": heads,
            "num_key_value_heads": heads,
            "head_dim": h // heads,
            "rms_norm_eps": 1e-5,
            "vocab_size": int(target["vocab_size"]),
            "max_position_embeddings": int(target.get("max_position_embeddings", 4096)),
            "rope_theta": 10000.0,
        },
        "draft_vocab_size": int(target["vocab_size"]),
        "target_hidden_size": h,
        "eagle_aux_hidden_state_layer_ids": [i + 1 for i in reads],
        "norm_before_residual": False,
        "block_size": 4,
    }


def write_eagle3(path: Path, target: Path | str, seed: int = 0) -> Path:
    """A tiny EAGLE-3 drafter for the model at ``target``, written to ``path``."""
    from mlx_vlm.speculative.drafters.eagle3.config import Eagle3Config
    from mlx_vlm.speculative.drafters.eagle3.eagle3 import Eagle3DraftModel

    tw = mx.load(str(Path(target) / "model.safetensors"))
    embed = next(v for k, v in tw.items() if k.endswith("model.embed_tokens.weight"))
    return _write(  # (an EAGLE-3 drafter reads its target's embedding)
        path, eagle3_config(_config(target)), Eagle3DraftModel, Eagle3Config, seed, embed
    )


def _config(target: Path | str) -> dict:
    return json.loads((Path(target) / "config.json").read_text())


def _write(
    path: Path, config: dict, model: Any, kind: Any, seed: int, embed: mx.array | None = None
) -> Path:
    """A drafter ``model(kind.from_dict(config))`` with random weights (``seed``), and
    ``embed`` as its embedding where given, written to ``path``."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    mx.random.seed(seed)
    weights = dict(tree_flatten(model(kind.from_dict(config)).parameters()))
    if embed is not None:
        weights["embed_tokens.weight"] = embed
    mx.eval(weights)
    mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "mlx"})
    (path / "config.json").write_text(json.dumps(config, indent=1))
    return path


def dflash_config(target: dict) -> dict:
    """A DFlash drafter's config.json (z-lab's layout: a qwen3 model_type and a
    ``dflash_config``) for a target with config ``target``: two layers reading the
    target's first, middle and last layers; its mask token the vocabulary's last."""
    n, h = int(target["num_hidden_layers"]), int(target["hidden_size"])
    heads = int(target.get("num_attention_heads", 4))
    vocab = int(target["vocab_size"])
    return {
        "model_type": "qwen3",
        "architectures": ["DFlashDraftModel"],
        "hidden_size": h,
        "intermediate_size": 2 * h,
        "num_hidden_layers": 2,
        "num_attention_heads": heads,
        "num_key_value_heads": heads,
        "head_dim": h // heads,
        "rms_norm_eps": 1e-6,
        "vocab_size": vocab,
        "max_position_embeddings": 4096,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
        "block_size": 8,
        "num_target_layers": n,
        "dflash_config": {"mask_token_id": vocab - 1, "target_layer_ids": [0, n // 2, n - 1]},
    }


def write_dflash(path: Path, target: Path | str, seed: int = 0) -> Path:
    """A tiny DFlash drafter for the model at ``target``, written to ``path`` (no
    embedding of its own: a DFlash drafter reads its target's)."""
    from mlx_vlm.speculative.drafters.qwen3_dflash import DFlashDraftModel, ModelConfig

    return _write(path, dflash_config(_config(target)), DFlashDraftModel, ModelConfig, seed)


def write_mtp(path: Path, base: Path | str, seed: int = 0) -> Path:
    """A copy of the tiny Qwen3.5 model at ``base`` with one MTP layer of its own
    (``mtp.*`` tensors, random; ``mtp_num_hidden_layers: 1``), written to ``path``: what
    a Qwen3.5 checkpoint ships, read by mlx-vlm's splitter (mlx-lm drops it)."""
    import shutil

    from mlx_vlm.speculative.drafters.qwen3_5_mtp.config import Qwen3_5MTPConfig
    from mlx_vlm.speculative.drafters.qwen3_5_mtp.qwen3_5_mtp import Qwen3_5MTPDraftModel

    path = Path(path)
    shutil.rmtree(path, ignore_errors=True)
    shutil.copytree(base, path)
    config = json.loads((path / "config.json").read_text()) | {"mtp_num_hidden_layers": 1}
    (path / "config.json").write_text(json.dumps(config, indent=1))
    mx.random.seed(seed)
    module = Qwen3_5MTPDraftModel(Qwen3_5MTPConfig.from_dict({"text_config": config}))
    weights = dict(mx.load(str(path / "model.safetensors")))
    weights.update({"mtp." + k: v for k, v in tree_flatten(module.parameters())})
    mx.eval(weights)
    mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "mlx"})
    return path
