"""Helpers that build model variants for tests (EOS on a chosen token, LoRA adapters)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten


def with_eos(src: str, dst: Path, eos_token_id: int) -> str:
    """A copy of model ``src`` whose config makes ``eos_token_id`` an end-of-sequence token."""
    shutil.copytree(src, dst, dirs_exist_ok=True)
    config = json.loads((dst / "config.json").read_text())
    config["eos_token_id"] = [config["eos_token_id"], eos_token_id]
    (dst / "config.json").write_text(json.dumps(config))
    return str(dst)


def write_lora_adapter(base: str, dst: Path, seed: int = 0) -> str:
    """A random (non-zero) LoRA adapter for ``base`` in mlx-lm's adapter format."""
    from mlx_lm import load
    from mlx_lm.tuner.utils import linear_to_lora_layers

    model, _ = load(base)
    params = {
        "rank": 4,
        "scale": 20.0,
        "dropout": 0.0,
        "keys": ["self_attn.q_proj", "self_attn.v_proj"],
    }
    linear_to_lora_layers(model, 2, params)
    mx.random.seed(seed)
    lora = {
        k: mx.random.normal(v.shape) * 0.5
        for k, v in tree_flatten(model.parameters())
        if k.rsplit(".", 1)[-1] in ("lora_a", "lora_b")
    }
    dst.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(dst / "adapters.safetensors"), lora)
    config = {"fine_tune_type": "lora", "num_layers": 2, "lora_parameters": params}
    (dst / "adapter_config.json").write_text(json.dumps(config))
    return str(dst)


def noisy_copy(
    src: str, dst: Path, scale: float, seed: int = 0, parts: tuple[str, ...] = ("mlp",)
) -> str:
    """A copy of model ``src`` with Gaussian noise (``scale``) added to the weights whose
    names contain one of ``parts`` (its MLP): a draft that agrees with ``src`` often but
    not always."""
    shutil.copytree(src, dst, dirs_exist_ok=True)
    weights = mx.load(str(dst / "model.safetensors"))
    mx.random.seed(seed)
    noisy = {
        k: v + scale * mx.random.normal(v.shape) if any(p in k for p in parts) else v
        for k, v in weights.items()
    }
    mx.save_safetensors(str(dst / "model.safetensors"), noisy, metadata={"format": "mlx"})
    return str(dst)
