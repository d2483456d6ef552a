"""Tiny local models for demos, tests and benchmarks where no model hub is reachable.

Each model is a real mlx-lm checkpoint on disk (config.json, safetensors
weights, a small BPE tokenizer and a chat template), loaded through the
same ``mlx_lm.load`` path as any hub model: llama by default, or any of
:data:`ARCHS` (sliding-window, linear-attention, SSM hybrid and MoE shapes, each
with a window or state small enough that short prompts pass it). Weights are
random but deterministic for a given seed, so greedy output is reproducible.
"""

from __future__ import annotations

import importlib
import json
import random
import string
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
SPECIAL_TOKENS = ["<pad>", "<unk>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>"]

_WORDS = (
    "the a queue worker model token draft target redis job batch result metric apple "
    "silicon mac mini fleet speculative decoding verify accept reject cache memory warm "
    "cold load evict budget prompt completion chat system user assistant stop length "
    "seed sample greedy temperature fast slow time second minute hour day week write "
    "read poll list push pop key value json line file error reason retry crash restart "
    "signal heartbeat lease timeout count rate ratio plot bench test run pass fail"
).split()


@dataclass(frozen=True)
class TinySpec:
    """Shape of a tiny llama model."""

    layers: int = 2
    hidden: int = 64
    intermediate: int = 128
    heads: int = 4
    kv_heads: int = 2
    vocab: int = 512
    context: int = 512
    seed: int = 0
    tokenizer_seed: int = 0
    tied: bool = True
    # Projection weights are scaled up from mlx's default init: at scale 1 a
    # random model repeats one token forever; at 4 its output varies with context.
    weight_scale: float = 4.0
    # A "copy" draft: attention and MLP outputs zeroed, so with tied embeddings
    # it predicts the last token again (agrees with a target stuck in repeats).
    copy_last_token: bool = False
    # "tiny": a BPE of exactly ``vocab`` entries trained on a small word corpus;
    # "bpe32k": a byte-level BPE of ``vocab`` entries (e.g. 32,000) trained on
    # Python's own standard library (code and English docs: a realistic vocabulary).
    tokenizer: str = "tiny"
    # Every block's output at 1%: the target's greedy output repeats its last token (what
    # a copy draft predicts) at the full model's cost. Gemma's post-norms are scaled.
    repeats: bool = False
    # Any of ARCHS; ``window``: the sliding window of architectures that have one.
    arch: str = "llama"
    window: int = 16
    # > 0: a "quoting" model (llama, one head, tied): its first layer's attention is a
    # delay line, so its greedy token at position m is the token at m + 1 - quote; it
    # replays its context from ``quote`` tokens back (the end of its prompt). What
    # copy-heavy jobs do, built in (its other layers only cost their compute).
    quote: int = 0


def _corpus(seed: int, n_lines: int = 400) -> list[str]:
    rng = random.Random(seed)
    words = list(_WORDS)
    rng.shuffle(words)
    lines = []
    for _ in range(n_lines):
        n = rng.randint(4, 14)
        lines.append(
            " ".join(
                rng.choice(words[: 20 + rng.randint(0, len(words) - 20)]) for _ in range(n)
            ).capitalize()
            + "."
        )
    return lines


def train_tiny_bpe(specials: list[str], vocab: int, seed: int = 0) -> Any:
    """A Metaspace BPE (``tokenizers.Tokenizer``) of at most ``vocab`` entries, ``specials``
    first, trained on the small word corpus of ``seed``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=specials,
        initial_alphabet=list(string.ascii_letters + string.digits + string.punctuation),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(seed), trainer=trainer)
    return tok


def write_tokenizer(path: Path, vocab: int = 512, seed: int = 0) -> None:
    """Train a BPE tokenizer of exactly ``vocab`` entries and save it in HF form.

    Different seeds give different vocabularies of the same size (a draft built
    with another seed has a "compatible looking" vocab_size but is not compatible).
    """
    tok = train_tiny_bpe(SPECIAL_TOKENS, vocab, seed)
    if tok.get_vocab_size() != vocab:
        raise RuntimeError(f"tokenizer has {tok.get_vocab_size()} entries, wanted {vocab}")
    save_tokenizer(tok, path, CHAT_TEMPLATE, unk_token="<unk>")


def _stdlib_corpus(limit_bytes: int) -> list[str]:
    """Deterministic text for a realistic vocabulary: the standard library's sources."""
    import sysconfig

    root = Path(sysconfig.get_paths()["stdlib"])
    texts, total = [], 0
    for path in sorted(root.glob("**/*.py")):
        if "test" in path.parts or "site-packages" in path.parts:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        texts.append(text)
        total += len(text)
        if total >= limit_bytes:
            break
    return texts


def train_bytelevel_bpe(texts: list[str], vocab: int) -> Any:
    """A byte-level BPE (the GPT-2 / Llama 3 kind) trained on ``texts``: a
    ``tokenizers.Tokenizer`` of at most ``vocab`` entries (the special tokens first)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def write_bytelevel_tokenizer(
    path: Path, vocab: int = 32000, corpus_bytes: int = 8_000_000
) -> None:
    """A byte-level BPE of exactly ``vocab`` entries trained on the standard library."""
    tok = train_bytelevel_bpe(_stdlib_corpus(corpus_bytes), vocab)
    if tok.get_vocab_size() != vocab:
        raise RuntimeError(f"tokenizer has {tok.get_vocab_size()} entries, wanted {vocab}")
    save_tokenizer(tok, path, CHAT_TEMPLATE)


def save_tokenizer(tok: Any, path: Path, chat_template: str, unk_token: str | None = None) -> None:
    """Save a ``tokenizers.Tokenizer`` in the HF form ``mlx_lm.load`` reads."""
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "pad_token": "<pad>",
        "model_max_length": 1_000_000,
        "add_bos_token": False,
        "chat_template": chat_template,
    } | ({"unk_token": unk_token} if unk_token else {})
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    (path / "special_tokens_map.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"})
    )


def _arch_fields(spec: TinySpec) -> dict[str, Any]:
    """What each architecture's config needs beyond the llama-shaped fields."""
    w, h = spec.window, spec.hidden
    tiny = h <= 64
    linear = {  # Qwen3-Next / Qwen3.5 gated delta-net layers; 3 : 1 full attention (tiny 1 : 1)
        "linear_num_value_heads": 2 if tiny else spec.heads,
        "linear_num_key_heads": 2 if tiny else spec.heads // 2,
        "linear_key_head_dim": 16 if tiny else 128,
        "linear_value_head_dim": 16 if tiny else 128,
        "linear_conv_kernel_dim": 4,
        "partial_rotary_factor": 0.25,
        "full_attention_interval": 2 if spec.layers < 8 else 4,
    }
    moe = {
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "moe_intermediate_size": spec.intermediate // 2,
        "norm_topk_prob": True,
    }
    return {
        "llama": {},
        "qwen2": {},  # not in ARCHS (llama-shaped, with Q/K/V biases): GGUF round trips
        "qwen3": {},
        "qwen3_moe": moe,
        "gemma3_text": {
            "query_pre_attn_scalar": h // spec.heads,
            "sliding_window": w,
            "sliding_window_pattern": 6 if spec.layers >= 6 else 2,  # Gemma 3: 5 local : 1
            "rope_local_base_freq": 10000.0,
        },
        "gemma4_text": {
            "global_head_dim": 2 * (h // spec.heads),
            "vocab_size_per_layer_input": spec.vocab,
            "hidden_size_per_layer_input": 16,
            "num_kv_shared_layers": 0,
            "sliding_window": w,
            "sliding_window_pattern": 2,
            "use_double_wide_mlp": False,
        },
        "gpt_oss": {
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "sliding_window": w,
            "layer_types": ["sliding_attention", "full_attention"] * (spec.layers // 2),
        },
        "qwen3_next": linear | moe | {"shared_expert_intermediate_size": spec.intermediate // 2},
        "qwen3_5": linear,
        "nemotron_h": {
            "attention_bias": False,
            "mamba_num_heads": 4,
            "mamba_head_dim": 16,
            "mamba_proj_bias": False,
            "ssm_state_size": 16,
            "conv_kernel": 4,
            "n_groups": 1,
            "mlp_bias": False,
            "layer_norm_epsilon": 1e-5,
            "use_bias": False,
            "use_conv_bias": True,
            "hybrid_override_pattern": "M*M-" * (spec.layers // 4) or "M*",
        },
        "falcon_h1": {
            "mamba_d_ssm": h,
            "mamba_n_heads": 4,
            "mamba_d_head": h // 4,
            "mamba_d_state": 16,
            "mamba_chunk_size": 16,
        },
    }[spec.arch]


#: Architectures :func:`write_model` builds: llama-shaped, MoE, sliding-window
#: (Gemma 3/4, gpt-oss: ``RotatingKVCache`` layers), linear attention (Qwen3-Next,
#: Qwen3.5: ``ArraysCache``) and SSM hybrids (Nemotron-H, Falcon-H1).
ARCHS = (
    "llama",
    "qwen3",
    "qwen3_moe",
    "gemma3_text",
    "gemma4_text",
    "gpt_oss",
    "qwen3_next",
    "qwen3_5",
    "nemotron_h",
    "falcon_h1",
)


def model_config(spec: TinySpec, eos_token_id: int) -> dict:
    """The config.json of a tiny model of ``spec.arch``."""
    return {
        "model_type": spec.arch,
        "head_dim": spec.hidden // spec.heads,
        "hidden_size": spec.hidden,
        "num_hidden_layers": spec.layers,
        "intermediate_size": spec.intermediate,
        "num_attention_heads": spec.heads,
        "num_key_value_heads": spec.kv_heads,
        "rms_norm_eps": 1e-5,
        "vocab_size": spec.vocab,
        "max_position_embeddings": spec.context,
        "rope_theta": 10000.0,
        "tie_word_embeddings": spec.tied,
        "eos_token_id": eos_token_id,
        "torch_dtype": "float32",
    } | _arch_fields(spec)


def write_model(path: Path, spec: TinySpec = TinySpec()) -> Path:
    """Write a tiny random model (weights, config, tokenizer) to ``path``."""
    path = Path(path)
    if spec.tokenizer == "bpe32k":
        write_bytelevel_tokenizer(path, vocab=spec.vocab)
    else:
        write_tokenizer(path, vocab=spec.vocab, seed=spec.tokenizer_seed)
    vocab = json.loads((path / "tokenizer.json").read_text())["model"]["vocab"]
    config = model_config(spec, eos_token_id=vocab["</s>"])
    mx.random.seed(spec.seed)
    arch = importlib.import_module(f"mlx_lm.models.{spec.arch}")
    model = arch.Model(arch.ModelArgs.from_dict(config))
    weights = {
        k: v * spec.weight_scale if _scaled(spec.arch, k) else v
        for k, v in tree_flatten(model.parameters())
    }
    if spec.repeats:
        for k, v in weights.items():
            if k.endswith(("post_attention_layernorm.weight", "post_feedforward_layernorm.weight")):
                weights[k] = mx.full(v.shape, -0.99, v.dtype)  # Gemma norms scale by 1 + w
            elif k.endswith(("o_proj.weight", "down_proj.weight", "out_proj.weight")):
                weights[k] = v * 0.01
        if "lm_head.weight" in weights:  # its output layer is its embedding, as if tied
            weights["lm_head.weight"] = weights["model.embed_tokens.weight"]
    if spec.quote:
        _make_quoting(weights, spec)
    if spec.copy_last_token:
        for k in weights:
            if k.endswith(("o_proj.weight", "down_proj.weight")):
                weights[k] = mx.zeros_like(weights[k])
    mx.eval(weights)
    mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "mlx"})
    (path / "config.json").write_text(json.dumps(config, indent=1))
    return path


def _make_quoting(weights: dict[str, mx.array], spec: TinySpec) -> None:
    """Turn ``weights`` into a quoting model (``TinySpec.quote``), in place.

    Every embedding has rms 1 and the same first coordinate, so after the first norm
    that coordinate is a constant; layer 0's query and key read only it, placed on the
    rotary frequencies so that q_m . k_n = c * sum_i cos((m - n - d) theta_i), which
    peaks at m - n = d = quote - 1 (scaled so the next-best offset is 40 logits below).
    Its values copy the attended token's embedding into the residual 16-fold (MLP and
    every later layer write nothing), so the tied output layer picks that token.
    """
    if spec.arch != "llama" or not spec.tied or spec.heads != 1 or spec.kv_heads != 1:
        raise ValueError("a quoting model is a tied llama with one attention head")
    h, v, d = spec.hidden, spec.vocab, spec.quote - 1
    first = 0.5
    rest = mx.random.normal((v, h - 1), key=mx.random.key(spec.seed + 1))
    rest = rest * mx.sqrt((h - first**2) / mx.sum(rest * rest, axis=1, keepdims=True))
    weights["model.embed_tokens.weight"] = mx.concatenate([mx.full((v, 1), first), rest], 1)
    theta = 10000.0 ** (-mx.arange(0, h, 2, dtype=mx.float32) / h)
    offsets = mx.arange(1, spec.context, dtype=mx.float32)
    peak, runner_up = h / 2, mx.max(mx.sum(mx.cos(offsets[:, None] * theta), axis=1)).item()
    gain = (40.0 * h**0.5 / (peak - runner_up)) ** 0.5  # q and k share the scale
    half = h // 2
    wq = mx.zeros((h, h)).at[:half, 0].add(gain / first)
    wk = mx.zeros((h, h))
    wk = wk.at[:half, 0].add(mx.cos(d * theta) * gain / first)
    wk = wk.at[half:, 0].add(mx.sin(d * theta) * gain / first)
    for k in list(weights):
        if k.endswith(("o_proj.weight", "down_proj.weight")):
            weights[k] = mx.zeros_like(weights[k])
    layer = "model.layers.0.self_attn."
    weights[layer + "q_proj.weight"], weights[layer + "k_proj.weight"] = wq, wk
    weights[layer + "v_proj.weight"] = mx.eye(h)
    weights[layer + "o_proj.weight"] = 16.0 * mx.eye(h)
    for k in list(weights):
        if k.endswith("norm.weight"):
            weights[k] = mx.ones_like(weights[k])


def _scaled(arch: str, key: str) -> bool:
    """Whether a weight is scaled up (see ``TinySpec.weight_scale``): llama's every
    projection; other architectures' attention and MLP projections only (their state
    and gating parameters keep mlx's init)."""
    if arch == "llama":
        return not ("norm" in key or "embed" in key)
    return key.endswith(
        ("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight", "proj.weight")
    ) and not any(s in key for s in ("norm", "embed", "router", "gate.weight", "mixer"))


def ensure_model(path: Path, spec: TinySpec = TinySpec()) -> Path:
    """Build the model at ``path`` unless a build with the same spec is already there."""
    path = Path(path)
    stamp = path / "mlxq-tiny.json"
    want = json.dumps(spec.__dict__, sort_keys=True)
    if stamp.exists() and stamp.read_text() == want and (path / "model.safetensors").exists():
        return path
    write_model(path, spec)
    stamp.write_text(want)
    return path


#: A Hermes / Qwen-style chat template: tools in the system turn, calls as
#: ``<tool_call>\n{"name": ..., "arguments": ...}\n</tool_call>``, results as tool turns.
#: mlx-lm infers its ``json_tools`` parser from it.
HERMES_TEMPLATE = (
    "{%- if tools %}<|system|>You may call these functions:\n"
    "{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}\n"
    'Call one as <tool_call>\n{"name": <name>, "arguments": <args>}\n</tool_call></s>'
    "{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' and m.tool_calls %}<|assistant|>{{ m.content or '' }}"
    "{%- for tool_call in m.tool_calls %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
    '<tool_call>\n{"name": "{{ tool_call.name }}", "arguments": '
    "{{ tool_call.arguments | tojson }}}\n</tool_call>"
    "{%- endfor %}</s>"
    "{%- elif m.role == 'tool' %}<|user|><tool_response>\n{{ m.content }}\n</tool_response></s>"
    "{%- else %}<|{{ m.role }}|>{{ m.content }}</s>{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|assistant|>{%- endif %}"
)


#: An LFM2-style template (mlx-lm's ``pythonic`` family): tools listed as JSON, calls
#: written as ``<|tool_call_start|>[name(arg=value)]<|tool_call_end|>``.
PYTHONIC_TEMPLATE = (
    "{%- if tools %}<|system|><|tool_list_start|>{{ tools | tojson }}<|tool_list_end|></s>"
    "{%- endif %}"
    "{%- for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{%- endfor %}"
    "{%- if add_generation_prompt %}<|assistant|>{%- endif %}"
)
PYTHONIC_MARKERS = ("<|tool_call_start|>", "<|tool_call_end|>")


def ensure_pythonic_model(path: Path, spec: TinySpec = TinySpec(seed=7, context=4096)) -> Path:
    """A tiny model of mlx-lm's ``pythonic`` tool-call family."""
    return _with_markers(path, spec, PYTHONIC_MARKERS, PYTHONIC_TEMPLATE, "mlxq-pythonic.json")


#: A Mistral-style template (2025 models): ``[TOOL_CALLS]name[ARGS]{...}`` calls.
MISTRAL_TEMPLATE = (
    "{%- if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' and m.tool_calls %}"
    "{%- for tc in m.tool_calls %}[TOOL_CALLS]{{ tc.function.name }}[ARGS]"
    "{{ tc.function.arguments | tojson }}{%- endfor %}</s>"
    "{%- elif m.role == 'tool' %}[TOOL_RESULTS]{{ m.content }}[/TOOL_RESULTS]"
    "{%- elif m.role == 'assistant' %}{{ m.content }}</s>"
    "{%- else %}[INST]{{ m.content }}[/INST]{%- endif %}"
    "{%- endfor %}"
)
MISTRAL_MARKERS = ("[TOOL_CALLS]", "[ARGS]")


def ensure_mistral_model(path: Path, spec: TinySpec = TinySpec(seed=9, context=4096)) -> Path:
    """A tiny model of mlx-lm's ``mistral`` tool-call family."""
    return _with_markers(path, spec, MISTRAL_MARKERS, MISTRAL_TEMPLATE, "mlxq-mistral.json")


#: The tool model's call markers (each one token).
TOOL_MARKERS = ("<tool_call>", "</tool_call>")


def ensure_tool_model(path: Path, spec: TinySpec = TinySpec(seed=5, context=4096)) -> Path:
    """A tiny model whose chat template renders tools and calls (:data:`HERMES_TEMPLATE`)
    and whose byte-level tokenizer can write any text a call needs (newlines, JSON)."""
    return _with_markers(path, spec, TOOL_MARKERS, HERMES_TEMPLATE, "mlxq-tools.json")


def _with_markers(
    path: Path, spec: TinySpec, markers: tuple[str, ...], template: str, stamp_name: str
) -> Path:
    """A tiny model with a byte-level tokenizer in which each of ``markers`` is one added
    token (not special, as Qwen's are), and chat ``template``."""
    from tokenizers import AddedToken

    path = Path(path)
    stamp = path / stamp_name
    want = json.dumps(spec.__dict__, sort_keys=True)
    if stamp.exists() and stamp.read_text() == want and (path / "model.safetensors").exists():
        return path
    write_model(path, spec)
    texts = (
        _corpus(spec.tokenizer_seed, 2000)
        + [
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
            '{"type": "object", "properties": {"unit": {"enum": ["c", "f"]}}, "required": []}',
        ]
        * 50
    )
    tok = train_bytelevel_bpe(texts, spec.vocab - len(markers))
    tok.add_tokens([AddedToken(m, special=False, normalized=False) for m in markers])
    if tok.get_vocab_size() != spec.vocab:
        raise RuntimeError(f"tokenizer has {tok.get_vocab_size()} entries, wanted {spec.vocab}")
    save_tokenizer(tok, path, template)
    stamp.write_text(want)
    return path


#: A reasoning model's template (as Qwen3.5's or DeepSeek-R1's): the generation
#: prompt opens a thinking block, or, with ``enable_thinking`` false, an empty one.
THINKING_TEMPLATE = (
    "{%- if reasoning_effort is defined %}<|system|>effort: {{ reasoning_effort }}</s>{%- endif %}"
    "{%- for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{%- endfor %}"
    "{%- if add_generation_prompt %}<|assistant|>"
    "{%- if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{%- else %}<think>\n{%- endif %}{%- endif %}"
)
#: Its markers (each one token, as in Qwen's vocabulary).
THINK_MARKERS = ("<think>", "</think>")


def ensure_thinking_model(path: Path, spec: TinySpec = TinySpec(seed=6, context=4096)) -> Path:
    """A tiny reasoning model (:data:`THINKING_TEMPLATE`) with a byte-level tokenizer."""
    return _with_markers(path, spec, THINK_MARKERS, THINKING_TEMPLATE, "mlxq-thinking.json")


def ensure_thinking_tool_model(path: Path, spec: TinySpec = TinySpec(seed=8, context=4096)) -> Path:
    """A tiny reasoning model with tools: :data:`HERMES_TEMPLATE` whose generation
    prompt opens a thinking block (as Qwen3.5's does)."""
    template = HERMES_TEMPLATE.replace(
        "{%- if add_generation_prompt %}<|assistant|>{%- endif %}",
        "{%- if add_generation_prompt %}<|assistant|><think>\n{%- endif %}",
    )
    markers = TOOL_MARKERS + THINK_MARKERS
    return _with_markers(path, spec, markers, template, "mlxq-thinking-tools.json")


def ensure_demo_models(root: Path) -> tuple[Path, Path]:
    """A tiny target and a smaller draft sharing its tokenizer, built once under ``root``."""
    root = Path(root)
    target = ensure_model(
        root / "tiny-target", TinySpec(layers=4, hidden=128, intermediate=256, seed=1)
    )
    draft = ensure_model(
        root / "tiny-draft", TinySpec(layers=1, hidden=64, intermediate=128, seed=2)
    )
    return target, draft
