"""Tiny local vision-language models for tests and demos where no model hub is reachable.

Real Gemma 3 and 4, Mistral 3, SmolVLM (Idefics 3, SmolVLM 2) and Qwen2/2.5/3-VL checkpoints in
shape (config.json with ``vision_config``, safetensors weights in mlx-vlm's names, a BPE
tokenizer with the family's image tokens, a chat template that places image parts, the
image processor's and processor's configs), made with mlx-vlm's own model classes and
random weights (deterministic for a seed): mlx-vlm's ``load`` reads them as VLMs, mlx-lm's
``load`` all but SmolVLM as text models, as they read ``google/gemma-3-4b-it`` or
``Qwen/Qwen2.5-VL-3B-Instruct`` (SmolVLM's language model:
``worker.engine.vision.load_language``). A 56 x 56 image becomes 4 image tokens (Gemma:
SigLIP, pooled; Mistral: Pixtral, 2 x 2 merged, with its row breaks and end token;
SmolVLM: pixel-shuffled 2 x 2, between fake tokens after a global-image tag); Qwen's
resize it to 56 x 84, 3 x 2 merged tokens at 2-D positions (Qwen3: patches of 16, 64 x
64, 2 x 2, one deepstack layer). Needs mlx-vlm (``mlxq[vision]``).
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

from worker.dev.tinymodels import train_tiny_bpe

#: Gemma 3's template in miniature: a user turn's image parts become <start_of_image>,
#: which the processor expands to the image's tokens.
GEMMA3_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>"
    "{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for p in m['content'] %}"
    "{% if p['type'] == 'image' %}<start_of_image>{% elif p['type'] == 'text' %}"
    "{{ p['text'] }}{% endif %}{% endfor %}{% endif %}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
#: Mistral's: [IMG] per image part, which the processor expands to rows of [IMG] tokens
#: ended by [IMG_BREAK], and [IMG_END].
MISTRAL3_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}[INST]"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for p in m['content'] %}"
    "{% if p['type'] == 'image' %}[IMG]{% elif p['type'] == 'text' %}{{ p['text'] }}"
    "{% endif %}{% endfor %}{% endif %}[/INST]{% else %}{{ m['content'] }}</s>{% endif %}"
    "{% endfor %}"
)
GEMMA3_SPECIALS = (
    "<pad> <eos> <bos> <unk> <start_of_turn> <end_of_turn> <start_of_image> <end_of_image> "
    "<image_soft_token>"
).split()
MISTRAL3_SPECIALS = "<unk> <s> </s> <pad> [INST] [/INST] [IMG] [IMG_BREAK] [IMG_END]".split()
#: SmolVLM's (Idefics3's): <image> per image part, which the processor expands to
#: <fake_token_around_image><global-img> and the image's tokens, then the fake token again.
IDEFICS3_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m['role'] | capitalize }}:"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for p in m['content'] %}"
    "{% if p['type'] == 'image' %}<image>{% elif p['type'] == 'text' %}{{ p['text'] }}"
    "{% endif %}{% endfor %}{% endif %}<end_of_utterance>\n{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)
#: Qwen2-VL's: an image part becomes <|vision_start|><|image_pad|><|vision_end|>, whose pad
#: the processor repeats once per merged patch.
QWEN2VL_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for p in m['content'] %}"
    "{% if p['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif p['type'] == 'text' %}{{ p['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
QWEN2VL_SPECIALS = (
    "<unk> <|endoftext|> <|im_start|> <|im_end|> <|vision_start|> <|vision_end|> <|image_pad|> "
    "<|video_pad|>"
).split()
#: Gemma 4's: an image part is its image token, which the processor expands to <|image>
#: image tokens <image|>. (Plain turns: after Gemma's turn markers this tiny random model
#: writes only <unk>, which would make equal texts prove nothing.)
GEMMA4_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: "
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for p in m['content'] %}"
    "{% if p['type'] == 'image' %}<|image|>{% elif p['type'] == 'text' %}{{ p['text'] }}"
    "{% endif %}{% endfor %}{% endif %}\n{% endfor %}{% if add_generation_prompt %}answer:"
    "{% endif %}"
)
GEMMA4_SPECIALS = (
    "<pad> <eos> <bos> <unk> <start_of_turn> <end_of_turn> <|image> <image|> <|image|> "
    "<|audio> <audio|> <|audio|>"
).split()
IDEFICS3_SPECIALS = (
    "<unk> <s> </s> <pad> <fake_token_around_image> <image> <end_of_utterance> <global-img>"
).split()
IMAGE_SIZE = 56  # pixels a side: 4 x 4 patches of 14, merged or pooled to 2 x 2 tokens
#: The architectures: mlx-vlm's model_type, and its tiny text and vision configs.
ARCHS = (
    "gemma3",
    "mistral3",
    "idefics3",
    "smolvlm",
    "qwen2_vl",
    "qwen2_5_vl",
    "qwen3_vl",
    "qwen3_vl_moe",
    "gemma4",
)
_TEXT = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 4096,
}
_VISION = {
    "num_hidden_layers": 2,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_attention_heads": 2,
    "patch_size": 14,
    "image_size": IMAGE_SIZE,
}
_IMAGE = {
    "do_resize": True,
    "do_rescale": True,
    "rescale_factor": 1 / 255,
    "do_normalize": True,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "do_convert_rgb": True,
}


#: ``small``: a bench-sized VLM instead (224-pixel images, 64 image tokens, an 8 x 256
#: language model, a 4 x 256 tower): what image tokens and the tower cost, closer to a
#: real VLM's proportions, still seconds on a CPU.
_SMALL_TEXT = _TEXT | {
    "hidden_size": 256,
    "num_hidden_layers": 8,
    "intermediate_size": 1024,
    "head_dim": 64,
}
_SMALL_VISION = _VISION | {
    "num_hidden_layers": 4,
    "hidden_size": 256,
    "intermediate_size": 1024,
    "num_attention_heads": 4,
    "image_size": 224,
}


#: ``wide``: the tiny VLM with heads of 32 (quantized KV caches group at least 32 values).
_WIDE_TEXT = _TEXT | {"hidden_size": 128, "head_dim": 32}


def write_vlm(
    path: Path,
    seed: int = 0,
    arch: str = "gemma3",
    vocab: int = 512,
    small: bool = False,
    wide: bool = False,
) -> Path:
    """Write a tiny random VLM of ``arch`` (:data:`ARCHS`) to ``path`` (``small``: the
    bench-sized one; ``wide``: heads of 32)."""
    import importlib

    text_shape, vision_shape = (_SMALL_TEXT, _SMALL_VISION) if small else (_TEXT, _VISION)
    if wide:
        text_shape = _WIDE_TEXT
    # mRoPE's sections (temporal, height, width) over a head's frequencies: [2, 3, 3] of 8
    # (every shape here has head_dim = hidden / heads, as Qwen2-VL's configs imply)
    half = text_shape["head_dim"] // 2
    sections = [half // 4, 3 * half // 8, 3 * half // 8]
    side = vision_shape["image_size"]
    tokens = (side // 14 // 2) ** 2  # patches of 14, pooled or merged 2 x 2
    head = vision_shape["hidden_size"] // vision_shape["num_attention_heads"]

    if arch not in ARCHS:
        raise ValueError(f"tiny VLM architectures: {', '.join(ARCHS)}; not {arch!r}")
    path.mkdir(parents=True, exist_ok=True)
    gemma = arch == "gemma3"
    specials = {
        "gemma3": GEMMA3_SPECIALS,
        "mistral3": MISTRAL3_SPECIALS,
        "qwen2_vl": QWEN2VL_SPECIALS,
        "qwen2_5_vl": QWEN2VL_SPECIALS,
        "qwen3_vl": QWEN2VL_SPECIALS,
        "qwen3_vl_moe": QWEN2VL_SPECIALS,
        "gemma4": GEMMA4_SPECIALS,
    }.get(arch, IDEFICS3_SPECIALS)
    ids = _write_tokenizer(path, specials, vocab)
    tokenizer = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "pad_token": "<pad>",
        "unk_token": "<unk>",
        "model_max_length": 100_000,
        "add_bos_token": False,
    }
    if gemma:
        tokenizer |= {
            "bos_token": "<bos>",
            "eos_token": "<eos>",
            "chat_template": GEMMA3_TEMPLATE,
            "extra_special_tokens": {
                "boi_token": "<start_of_image>",
                "eoi_token": "<end_of_image>",
                "image_token": "<image_soft_token>",
            },
        }
        text = text_shape | {
            "model_type": "gemma3_text",
            "vocab_size": vocab,
            "sliding_window": 16,
            "sliding_window_pattern": 2,
            "query_pre_attn_scalar": text_shape["head_dim"],
            "mm_tokens_per_image": tokens,
        }
        vision = vision_shape | {"model_type": "siglip_vision_model"}
        config = {
            "image_token_index": ids["<image_soft_token>"],
            "boi_token_index": ids["<start_of_image>"],
            "eoi_token_index": ids["<end_of_image>"],
            "mm_tokens_per_image": tokens,
            "hidden_size": text_shape["hidden_size"],
            "pad_token_id": ids["<pad>"],
            "eos_token_id": [ids["<eos>"], ids["<end_of_turn>"]],
        }
        image = _IMAGE | {
            "image_processor_type": "Gemma3ImageProcessor",
            "processor_class": "Gemma3Processor",
            "size": {"height": side, "width": side},
            "resample": 2,
            "do_pan_and_scan": False,
        }
        processor = {"processor_class": "Gemma3Processor", "image_seq_length": tokens}
    elif arch in ("qwen2_vl", "qwen2_5_vl"):
        processor_name = "Qwen2VLProcessor" if arch == "qwen2_vl" else "Qwen2_5_VLProcessor"
        tokenizer |= {
            "pad_token": "<|endoftext|>",
            "eos_token": "<|im_end|>",
            "chat_template": QWEN2VL_TEMPLATE,
        }
        text = text_shape | {
            "model_type": arch,
            "vocab_size": vocab,
            "rms_norm_eps": 1e-6,
            "rope_theta": 10000.0,
            "rope_scaling": {"type": "mrope", "mrope_section": sections},
            "tie_word_embeddings": False,
        }
        text.pop("head_dim")  # (hidden / heads)
        vision = {
            "model_type": arch,
            "depth": vision_shape["num_hidden_layers"],
            "embed_dim": vision_shape["hidden_size"],
            "hidden_size": text_shape["hidden_size"],
            "num_heads": vision_shape["num_attention_heads"],
            "mlp_ratio": 2,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
        }
        if arch == "qwen2_5_vl":  # (windowed attention in the tower, all but its last block)
            vision |= {
                "hidden_size": vision_shape["hidden_size"],
                "intermediate_size": vision_shape["intermediate_size"],
                "out_hidden_size": text_shape["hidden_size"],
                "window_size": 56,
                "fullatt_block_indexes": [vision_shape["num_hidden_layers"] - 1],
            }
        config = text | _qwen_ids(ids)
        # Images resized to multiples of 28 within these: 56 x 84 (6 x 4 patches of 14,
        # 3 x 2 tokens once merged: rows and columns differ, as 2-D positions must).
        image = _IMAGE | {
            "image_processor_type": "Qwen2VLImageProcessor",
            "processor_class": processor_name,
            "min_pixels": 28 * 28,
            "max_pixels": 56 * 84,
            "patch_size": 14,
            "merge_size": 2,
            "temporal_patch_size": 2,
            "resample": 3,
        }
        processor = {"processor_class": processor_name}
    elif arch == "gemma4":
        tokenizer |= {
            "bos_token": "<bos>",
            "eos_token": "<eos>",
            "chat_template": GEMMA4_TEMPLATE,
            "extra_special_tokens": {
                "boi_token": "<|image>",
                "eoi_token": "<image|>",
                "image_token": "<|image|>",
                "boa_token": "<|audio>",
                "eoa_token": "<audio|>",
                "audio_token": "<|audio|>",
            },
        }
        head = text_shape["head_dim"]
        text = text_shape | {
            "model_type": "gemma4_text",
            "vocab_size": vocab,
            "vocab_size_per_layer_input": vocab,
            "hidden_size_per_layer_input": 16,
            "global_head_dim": 2 * head,
            "num_kv_shared_layers": 0,
            "sliding_window": 16,
            "layer_types": ["sliding_attention", "full_attention"],
            "use_double_wide_mlp": False,
            "tie_word_embeddings": True,
            # (stated, as real checkpoints do: mlx-lm's and mlx-vlm's defaults differ)
            "rope_parameters": {
                "full_attention": {
                    "partial_rotary_factor": 0.25,
                    "rope_theta": 1000000.0,
                    "rope_type": "proportional",
                },
                "sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"},
            },
        }
        # Patches of 16 pooled 3 x 3: images resized to at most 16 soft tokens.
        vision = {
            "model_type": "gemma4_vision",
            "hidden_size": vision_shape["hidden_size"],
            "intermediate_size": vision_shape["intermediate_size"],
            "num_hidden_layers": vision_shape["num_hidden_layers"],
            "num_attention_heads": vision_shape["num_attention_heads"],
            "num_key_value_heads": vision_shape["num_attention_heads"],
            "head_dim": head,
            "global_head_dim": head,
            "patch_size": 16,
            "pooling_kernel_size": 3,
            "position_embedding_size": 64,
            "default_output_length": 16,
        }
        config = {
            "image_token_id": ids["<|image|>"],
            "boi_token_id": ids["<|image>"],
            "eoi_token_id": ids["<image|>"],
            "audio_token_id": ids["<|audio|>"],
            "boa_token_id": ids["<|audio>"],
            "eoa_token_id": ids["<audio|>"],
            "vision_soft_tokens_per_image": 16,
            "hidden_size": text_shape["hidden_size"],
            "pad_token_id": ids["<pad>"],
            "eos_token_id": [ids["<eos>"], ids["<end_of_turn>"]],
        }
        image = {
            "image_processor_type": "Gemma4ImageProcessor",
            "processor_class": "Gemma4Processor",
            "patch_size": 16,
            "pooling_kernel_size": 3,
            "max_soft_tokens": 16,
            "do_rescale": True,
            "rescale_factor": 1 / 255,
        }
        processor = {"processor_class": "Gemma4Processor", "image_processor": image}
    elif arch in ("qwen3_vl", "qwen3_vl_moe"):
        tokenizer |= {
            "pad_token": "<|endoftext|>",
            "eos_token": "<|im_end|>",
            "chat_template": QWEN2VL_TEMPLATE,
        }
        text = text_shape | {
            "model_type": f"{arch}_text",
            "vocab_size": vocab,
            "rms_norm_eps": 1e-6,
            "rope_theta": 10000.0,
            # interleaved sections over head_dim / 2 frequencies
            "rope_scaling": {"rope_type": "default", "mrope_section": sections},
            "tie_word_embeddings": False,
        }
        if arch == "qwen3_vl_moe":  # 4 experts, 2 a token, every layer sparse
            text |= {
                "num_experts": 4,
                "num_experts_per_tok": 2,
                "moe_intermediate_size": 32,
                "decoder_sparse_step": 1,
                "mlp_only_layers": [],
                "norm_topk_prob": True,
            }
        vision = {
            "model_type": arch,
            "depth": vision_shape["num_hidden_layers"],
            "hidden_size": vision_shape["hidden_size"],
            "intermediate_size": vision_shape["intermediate_size"],
            "out_hidden_size": text_shape["hidden_size"],
            "num_heads": vision_shape["num_attention_heads"],
            "patch_size": 16,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "num_position_embeddings": 16,
            "deepstack_visual_indexes": [0],  # (the tower's first block, added after layer 0)
        }
        config = _qwen_ids(ids)
        # Patches of 16 merged 2 x 2: the tests' images resized to 64 x 64, 2 x 2 tokens.
        image = _IMAGE | {
            "image_processor_type": "Qwen3VLImageProcessor",
            "processor_class": "Qwen3VLProcessor",
            "min_pixels": 32 * 32,
            "max_pixels": 96 * 64,
            "patch_size": 16,
            "merge_size": 2,
            "temporal_patch_size": 2,
        }
        processor = {"processor_class": "Qwen3VLProcessor"}
    elif arch in ("idefics3", "smolvlm"):  # (SmolVLM 1 is idefics3; SmolVLM 2 smolvlm)
        tokenizer |= {
            "bos_token": "<s>",
            "eos_token": "<end_of_utterance>",
            "chat_template": IDEFICS3_TEMPLATE,
        }
        text = text_shape | {
            "model_type": "llama",
            "vocab_size": vocab,
            "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0,
            "tie_word_embeddings": False,
        }
        text.pop("head_dim")  # (hidden / heads: Idefics3's text model has no head_dim)
        vision = vision_shape | {"model_type": f"{arch}_vision"}
        config = {
            "image_token_id": ids["<image>"],
            "scale_factor": 2,
            "eos_token_id": ids["<end_of_utterance>"],
        }
        family = "Idefics3" if arch == "idefics3" else "SmolVLM"
        image = _IMAGE | {
            "image_processor_type": f"{family}ImageProcessor",
            "processor_class": f"{family}Processor",
            "size": {"longest_edge": side},
            "max_image_size": {"longest_edge": side},
            "do_image_splitting": False,
            "do_pad": True,
            "resample": 1,
        }
        processor = {"processor_class": f"{family}Processor", "image_seq_len": tokens}
    else:
        tokenizer |= {"bos_token": "<s>", "eos_token": "</s>", "chat_template": MISTRAL3_TEMPLATE}
        text = text_shape | {
            "model_type": "mistral",
            "vocab_size": vocab,
            "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0,
            "tie_word_embeddings": False,
        }
        vision = vision_shape | {"model_type": "pixtral", "head_dim": head, "rope_theta": 10000.0}
        config = {
            "image_token_index": ids["[IMG]"],
            "spatial_merge_size": 2,
            "vision_feature_layer": -1,
            "multimodal_projector_bias": False,
            "projector_hidden_act": "gelu",
            "eos_token_id": ids["</s>"],
        }
        image = _IMAGE | {
            "image_processor_type": "PixtralImageProcessor",
            "processor_class": "Mistral3Processor",
            "size": {"longest_edge": side},
            "patch_size": {"height": 14, "width": 14},
            "resample": 3,
        }
        processor = {
            "processor_class": "Mistral3Processor",
            "patch_size": 14,
            "spatial_merge_size": 2,
            "image_token": "[IMG]",
            "image_break_token": "[IMG_BREAK]",
            "image_end_token": "[IMG_END]",
        }
    config = {
        "model_type": arch,
        "vocab_size": vocab,
        "text_config": text,
        "vision_config": vision,
        "torch_dtype": "float32",
    } | config
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer, indent=1))
    (path / "config.json").write_text(json.dumps(config, indent=1))
    (path / "preprocessor_config.json").write_text(json.dumps(image, indent=1))
    (path / "processor_config.json").write_text(json.dumps(processor))
    module = importlib.import_module(f"mlx_vlm.models.{arch}")
    args = module.ModelConfig.from_dict(config)
    args.text_config = module.TextConfig.from_dict(text)
    args.vision_config = module.VisionConfig.from_dict(vision)
    mx.random.seed(seed)
    model = module.Model(args)
    # Scaled up from mlx's init (as tinymodels does): output that varies with its input.
    scaled = ("proj.weight", "fc1.weight", "fc2.weight", "linear_1.weight", "linear_2.weight")
    weights = {k: v * 4 if k.endswith(scaled) else v for k, v in tree_flatten(model.parameters())}
    if arch == "gemma4":  # (its images change its text then)
        weights["embed_vision.embedding_projection.weight"] *= 4
    if gemma:
        weights.pop("language_model.lm_head.weight")  # tied, as Gemma's checkpoints are
    mx.eval(weights)
    mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "mlx"})
    return path


def _qwen_ids(ids: dict[str, int]) -> dict[str, int]:
    """A Qwen VLM config's token ids."""
    return {
        "image_token_id": ids["<|image_pad|>"],
        "video_token_id": ids["<|video_pad|>"],
        "vision_start_token_id": ids["<|vision_start|>"],
        "vision_end_token_id": ids["<|vision_end|>"],
        "eos_token_id": ids["<|im_end|>"],
    }


def _write_tokenizer(path: Path, specials: list[str], vocab: int) -> dict[str, int]:
    """A BPE of ``vocab`` entries (``specials`` first), saved as tokenizer.json; its ids."""
    tok = train_tiny_bpe(specials, vocab)
    tok.save(str(path / "tokenizer.json"))
    return dict(tok.get_vocab())


def ensure_vlm(
    path: Path, seed: int = 0, arch: str = "gemma3", small: bool = False, wide: bool = False
) -> Path:
    """``path`` holding the tiny (or ``small``, or ``wide``) VLM of ``arch`` and ``seed``
    (written once)."""
    path = Path(path)
    if not (path / "model.safetensors").exists():
        write_vlm(path, seed, arch, small=small, wide=wide)
    return path
