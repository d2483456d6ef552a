"""A tiny random Whisper checkpoint in mlx-whisper's format (``config.json`` and
``weights.safetensors``): the same bytes on every machine (NumPy's seeded generator, not
MLX's), for tests and benchmarks of audio jobs. Its vocabulary is Whisper's own (the
multilingual tokenizer ships inside mlx-whisper); its text is noise, which is all an
equality test needs. No real Whisper weights are run here."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

#: Whisper's multilingual vocabulary (mlx-whisper's ``is_multilingual`` needs >= 51865).
VOCAB = 51865


def tiny_config(text_ctx: int = 96, state: int = 64, layers: int = 2) -> dict[str, int]:
    """A Whisper config: 80 mel bins and 1,500 audio positions (30 s windows, as every
    Whisper), everything else small."""
    return {
        "n_mels": 80,
        "n_audio_ctx": 1500,
        "n_audio_state": state,
        "n_audio_head": 2,
        "n_audio_layer": layers,
        "n_vocab": VOCAB,
        "n_text_ctx": text_ctx,
        "n_text_state": state,
        "n_text_head": 2,
        "n_text_layer": layers,
    }


def write_whisper(path: Path, seed: int = 0, text_ctx: int = 96, scale: float = 0.3) -> Path:
    """A tiny random Whisper in ``path``. ``scale``: the weights' spread (larger gives the
    decoder sharper, less tied choices)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_whisper.whisper import ModelDimensions, Whisper

    path.mkdir(parents=True, exist_ok=True)
    config = tiny_config(text_ctx)
    shapes = tree_flatten(Whisper(ModelDimensions(**config), mx.float32).parameters())
    rng = np.random.default_rng(seed)
    weights = {}
    for name, value in shapes:
        if name.endswith(("ln.weight", "_ln.weight", "ln_post.weight")):
            array = np.ones(value.shape, np.float32)
        elif name.endswith(".bias"):
            array = np.zeros(value.shape, np.float32)
        else:
            fan_in = value.shape[-1] if len(value.shape) > 1 else 1
            array = rng.standard_normal(value.shape).astype(np.float32)
            array *= scale * 4 / np.sqrt(fan_in) if "embedding" not in name else scale
        weights[name] = mx.array(array.astype(np.float16))
    mx.save_safetensors(str(path / "weights.safetensors"), weights)
    (path / "config.json").write_text(json.dumps({**config, "model_type": "whisper"}, indent=1))
    return path
