"""Write a tiny mlx-lm model as a GGUF file the way llama.cpp's converter does, for round trips.

Conventions as llama.cpp applies them: llama Q/K rows permuted for GGML's RoPE (with
mlx-lm's own ``mlx_lm.gguf.permute_weights``, the code mlx-lm exports GGUF with), Gemma
norms stored as ``1 + weight``, a byte-level BPE as a ``gpt2`` vocabulary with merges.
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import mlx.core as mx
import numpy as np
from mlx_lm.gguf import permute_weights

_LAYER = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_GEMMA = {
    "pre_feedforward_layernorm": "ffn_norm",
    "post_attention_layernorm": "post_attention_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}
_TOP = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
ARCH = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3_text": "gemma3"}


def _name(name: str, model_type: str) -> str:
    base, kind = name.rsplit(".", 1)
    if base in _TOP:
        return f"{_TOP[base]}.{kind}"
    _, _, layer, part = base.split(".", 3)
    table = _LAYER | (
        _GEMMA if model_type == "gemma3_text" else {"post_attention_layernorm": "ffn_norm"}
    )
    return f"blk.{layer}.{table[part]}.{kind}"


def export(model_dir: str | Path, out: Path, qtype: str = "F32") -> Path:
    """``model_dir`` (an mlx-lm checkpoint with a byte-level BPE) as a GGUF file at ``out``;
    ``qtype`` "Q8_0" quantizes every matrix whose rows split into 32-value blocks."""
    model_dir = Path(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    mt = config["model_type"]
    arch = ARCH[mt]
    w = gguf.GGUFWriter(str(out), arch)
    heads, kv = config["num_attention_heads"], config["num_key_value_heads"]
    for key, value in {
        "block_count": config["num_hidden_layers"],
        "context_length": config["max_position_embeddings"],
        "embedding_length": config["hidden_size"],
        "feed_forward_length": config["intermediate_size"],
        "attention.head_count": heads,
        "attention.head_count_kv": kv,
        "attention.key_length": config["head_dim"],
        "attention.value_length": config["head_dim"],
    }.items():
        w.add_uint32(f"{arch}.{key}", value)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", config["rms_norm_eps"])
    w.add_float32(f"{arch}.rope.freq_base", config["rope_theta"])
    if "sliding_window" in config:
        w.add_uint32(f"{arch}.attention.sliding_window", config["sliding_window"])
    _vocab(w, model_dir)
    for name, array in sorted(mx.load(str(model_dir / "model.safetensors")).items()):
        a = np.array(array.astype(mx.float32))
        if mt == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            n = heads if "q_proj" in name else kv
            a = np.array(permute_weights(mx.array(a), n, n))
        if mt == "gemma3_text" and name.endswith("norm.weight"):
            a = a + 1.0
        if qtype == "Q8_0" and a.ndim == 2 and a.shape[1] % 32 == 0:
            q = gguf.quants.quantize(a, gguf.GGMLQuantizationType.Q8_0)
            w.add_tensor(
                _name(name, mt), q, raw_shape=q.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0
            )
        else:
            w.add_tensor(_name(name, mt), a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def _vocab(w: gguf.GGUFWriter, model_dir: Path) -> None:
    tj = json.loads((model_dir / "tokenizer.json").read_text())
    tc = json.loads((model_dir / "tokenizer_config.json").read_text())
    vocab = tj["model"]["vocab"]
    added = {t["id"]: t for t in tj.get("added_tokens", [])}
    tokens = sorted(vocab, key=vocab.__getitem__)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([3 if i in added and added[i]["special"] else 1 for i in range(len(tokens))])
    merges = tj["model"]["merges"]
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    w.add_bos_token_id(vocab[tc["bos_token"]])
    w.add_eos_token_id(vocab[tc["eos_token"]])
    w.add_add_bos_token(False)
    if tc.get("chat_template"):
        w.add_chat_template(tc["chat_template"])
