"""A tiny local vision-language model for tests and demos where no model hub is reachable.

A real Gemma 3 checkpoint in shape (config.json with ``vision_config``, safetensors
weights in mlx-vlm's names, a BPE tokenizer with Gemma's image tokens, a chat template
that places image parts, the image processor's and processor's configs), made with
mlx-vlm's own model classes and random weights (deterministic for a seed): mlx-vlm's
``load`` reads it as a VLM, mlx-lm's ``load`` as a text model, as they read
``google/gemma-3-4b-it``. A 56 x 56 image becomes 4 image tokens. Needs mlx-vlm
(``mlxq[vision]``).
"""

from __future__ import annotations

import json
import string
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

from worker.dev.tinymodels import _corpus

SPECIAL_TOKENS = [
    "<pad>",
    "<eos>",
    "<bos>",
    "<unk>",
    "<start_of_turn>",
    "<end_of_turn>",
    "<start_of_image>",
    "<end_of_image>",
    "<image_soft_token>",
]
#: Gemma 3's template in miniature: a user turn's image parts become <start_of_image>,
#: which the processor expands to the image's tokens.
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>"
    "{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for p in m['content'] %}"
    "{% if p['type'] == 'image' %}<start_of_image>{% elif p['type'] == 'text' %}"
    "{{ p['text'] }}{% endif %}{% endfor %}{% endif %}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
IMAGE_SIZE = 56  # pixels a side: 4 x 4 patches of 14, pooled to 2 x 2 image tokens


def write_vlm(path: Path, seed: int = 0, vocab: int = 512) -> Path:
    """Write a tiny random Gemma 3 VLM to ``path``."""
    from mlx_vlm.models import gemma3
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    path.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=list(string.ascii_letters + string.digits + string.punctuation),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(0), trainer=trainer)
    tok.save(str(path / "tokenizer.json"))
    ids = tok.get_vocab()
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<bos>",
        "eos_token": "<eos>",
        "pad_token": "<pad>",
        "unk_token": "<unk>",
        "model_max_length": 100_000,
        "add_bos_token": False,
        "chat_template": TEMPLATE,
        "extra_special_tokens": {
            "boi_token": "<start_of_image>",
            "eoi_token": "<end_of_image>",
            "image_token": "<image_soft_token>",
        },
    }
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=1))
    text = {
        "model_type": "gemma3_text",
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "vocab_size": vocab,
        "sliding_window": 16,
        "sliding_window_pattern": 2,
        "query_pre_attn_scalar": 16,
        "mm_tokens_per_image": 4,
        "max_position_embeddings": 4096,
    }
    vision = {
        "model_type": "siglip_vision_model",
        "num_hidden_layers": 2,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_attention_heads": 2,
        "patch_size": 14,
        "image_size": IMAGE_SIZE,
    }
    config = {
        "model_type": "gemma3",
        "vocab_size": vocab,
        "image_token_index": ids["<image_soft_token>"],
        "boi_token_index": ids["<start_of_image>"],
        "eoi_token_index": ids["<end_of_image>"],
        "mm_tokens_per_image": 4,
        "hidden_size": 64,
        "pad_token_id": ids["<pad>"],
        "eos_token_id": [ids["<eos>"], ids["<end_of_turn>"]],
        "text_config": text,
        "vision_config": vision,
        "torch_dtype": "float32",
    }
    (path / "config.json").write_text(json.dumps(config, indent=1))
    image = {
        "image_processor_type": "Gemma3ImageProcessor",
        "processor_class": "Gemma3Processor",
        "size": {"height": IMAGE_SIZE, "width": IMAGE_SIZE},
        "do_resize": True,
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "resample": 2,
        "do_convert_rgb": True,
        "do_pan_and_scan": False,
    }
    (path / "preprocessor_config.json").write_text(json.dumps(image, indent=1))
    processor = {"processor_class": "Gemma3Processor", "image_seq_length": 4}
    (path / "processor_config.json").write_text(json.dumps(processor))
    args = gemma3.ModelConfig.from_dict(config)
    args.text_config = gemma3.TextConfig.from_dict(text)
    args.vision_config = gemma3.VisionConfig.from_dict(vision)
    mx.random.seed(seed)
    model = gemma3.Model(args)
    # Scaled up from mlx's init (as tinymodels does): output that varies with its input.
    weights = {
        k: v * 4 if k.endswith(("proj.weight", "fc1.weight", "fc2.weight")) else v
        for k, v in tree_flatten(model.parameters())
    }
    weights.pop("language_model.lm_head.weight")  # tied, as Gemma's checkpoints are
    mx.eval(weights)
    mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "mlx"})
    return path


def ensure_vlm(path: Path, seed: int = 0) -> Path:
    """``path`` holding the tiny VLM of ``seed`` (written once)."""
    path = Path(path)
    if not (path / "model.safetensors").exists():
        write_vlm(path, seed)
    return path
