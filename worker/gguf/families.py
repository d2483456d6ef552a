"""Which GGUF architectures map onto which mlx-lm model, and each family's conventions.

llama.cpp's converter changes some tensors on the way into a GGUF file; an import undoes it:

- Gemma's RMSNorm multiplies by ``1 + weight``; llama.cpp stores ``weight + 1`` (its norm
  multiplies by the weight), so every ``*_norm`` tensor of a Gemma file is shifted back.
- Llama-family files hold ``attn_q`` / ``attn_k`` with their rows permuted for GGML's
  interleaved ("normal") RoPE; mlx-lm's llama uses the rotate-half form, so the rows are
  permuted back. Qwen and Gemma use the NeoX form in both and are left alone.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

Meta = Callable[[str, Any], Any]  # (key without the "arch." prefix, default) -> value

_LAYER = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GEMMA3_LAYER = _LAYER | {
    "ffn_norm": "pre_feedforward_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_TOP = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_BLOCK = re.compile(r"blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")
_GLOBAL = re.compile(r"([a-z_]+)\.(weight|bias)$")


class UnsupportedModel(ValueError):
    """The file holds something this importer does not convert; the message names it."""


@dataclass(frozen=True)
class Family:
    arch: str  # general.architecture
    model_type: str  # mlx-lm's
    layer_names: dict[str, str]
    config: Callable[[Meta, int], dict[str, Any]]
    norm_shift: float = 0.0
    permute_qk: bool = False
    eos_pieces: tuple[str, ...] = ()  # end-of-turn pieces that also end generation

    def rename(self, name: str) -> str:
        if m := _BLOCK.match(name):
            layer, part, kind = m.groups()
            if part in self.layer_names:
                return f"model.layers.{layer}.{self.layer_names[part]}.{kind}"
        elif (m := _GLOBAL.match(name)) and m.group(1) in _TOP:
            return f"{_TOP[m.group(1)]}.{m.group(2)}"
        raise UnsupportedModel(f"tensor {name!r} has no place in mlx-lm's {self.model_type}")

    def convert(self, name: str, array: np.ndarray, meta: Meta) -> np.ndarray:
        """Undo the converter's changes to one tensor (``name`` is the GGUF name)."""
        if self.norm_shift and name.endswith("norm.weight"):
            array = array - self.norm_shift
        if self.permute_qk and re.search(r"\.attn_[qk]\.weight$", name):
            heads = meta("attention.head_count", None)
            if name.endswith("attn_k.weight"):
                heads = meta("attention.head_count_kv", heads)
            array = unpermute(array, int(heads))
        return array


def unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """The inverse of llama.cpp's row permutation of a Q or K projection: rows back in the
    rotate-half order (``mlx_lm.gguf.permute_weights`` is the forward one)."""
    return (
        w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def _common(meta: Meta, vocab_size: int) -> dict[str, Any]:
    heads = meta("attention.head_count", None)
    hidden = meta("embedding_length", None)
    if heads is None or hidden is None:
        raise UnsupportedModel("the file's metadata has no head count or embedding length")
    if isinstance(heads, list) or isinstance(meta("feed_forward_length", 0), list):
        raise UnsupportedModel("per-layer head counts or feed-forward sizes are not supported")
    head_dim = meta("attention.key_length", hidden // heads)
    rope_dims = meta("rope.dimension_count", head_dim)
    if rope_dims != head_dim:
        raise UnsupportedModel(
            f"partial rotary embeddings ({rope_dims} of {head_dim}) are not supported"
        )
    if meta("expert_count", 0):
        raise UnsupportedModel("mixture-of-experts GGUF files are not supported yet")
    config: dict[str, Any] = {
        "hidden_size": hidden,
        "num_hidden_layers": meta("block_count", None),
        "intermediate_size": meta("feed_forward_length", None),
        "num_attention_heads": heads,
        "num_key_value_heads": meta("attention.head_count_kv", heads),
        "head_dim": head_dim,
        "rms_norm_eps": meta("attention.layer_norm_rms_epsilon", 1e-6),
        "rope_theta": meta("rope.freq_base", 10_000.0),
        "max_position_embeddings": meta("context_length", 4096),
        "vocab_size": vocab_size,
    }
    scaling = meta("rope.scaling.type", None)
    if scaling not in (None, "none"):
        if scaling != "linear":
            raise UnsupportedModel(f"RoPE scaling {scaling!r} is not supported (linear only)")
        config["rope_scaling"] = {"type": "linear", "factor": meta("rope.scaling.factor", 1.0)}
    return config


def _llama(meta: Meta, vocab_size: int) -> dict[str, Any]:
    return _common(meta, vocab_size) | {"attention_bias": False, "mlp_bias": False}


def _gemma3(meta: Meta, vocab_size: int) -> dict[str, Any]:
    config = _common(meta, vocab_size)
    layers = config["num_hidden_layers"]
    # llama.cpp hard-codes what the file does not say: 5 local layers to 1 global, local
    # RoPE base 10,000, and attention scaled by head_dim except on the 62-layer 27B.
    scalar = (
        config["hidden_size"] // config["num_attention_heads"]
        if layers == 62
        else config["head_dim"]
    )
    return config | {
        "sliding_window": meta("attention.sliding_window", 512),
        "sliding_window_pattern": 6,
        "rope_local_base_freq": 10_000.0,
        "query_pre_attn_scalar": scalar,
    }


FAMILIES = {
    f.arch: f
    for f in (
        Family("llama", "llama", _LAYER, _llama, permute_qk=True),
        Family("qwen2", "qwen2", _LAYER, _common),
        Family("qwen3", "qwen3", _LAYER, _common),
        Family(
            "gemma3",
            "gemma3_text",
            _GEMMA3_LAYER,
            _gemma3,
            norm_shift=1.0,
            eos_pieces=("<end_of_turn>",),
        ),
    )
}


def family(arch: str) -> Family:
    if arch not in FAMILIES:
        known = ", ".join(sorted(FAMILIES))
        raise UnsupportedModel(f"GGUF architecture {arch!r} is not supported (supported: {known})")
    return FAMILIES[arch]
