"""Images in a job's prompt: the vision side of a vision-language model.

A VLM checkpoint is two things here. Its language model is loaded by mlx-lm, like any
chat model (mlx-lm reads Gemma 3 and Mistral 3 VLM checkpoints as text models; for
SmolVLM / Idefics 3, which it does not, :func:`load_language` builds its ``text_config``
architecture from the checkpoint's language weights): so every engine, cache type and
path is the one text jobs take. Its vision tower and projector
are loaded by mlx-vlm (``pip install 'mlxq[vision]'``) beside it, sharing the language
model's token embeddings (mlx-vlm's own copy of the language model is dropped before
its weights load).

A job with images is prepared by the model's own processor (mlx-vlm's: its image
placeholders expanded, pixels resized and normalized); its prompt is the processor's
token ids. Before any engine runs it, the start of its prompt through its last image
token is prefilled from the input embeddings (text embeddings with the projected image
features in place, ``get_input_embeddings`` of mlx-vlm) into a fresh cache
(:meth:`Vision.prefill`): the job then starts from that cache as from a kept prefix,
alone, batched, speculative or as n choices, and the rest of its prompt and every
generated token are plain token ids. Greedy text equals mlx-vlm's own ``generate``
(tests/test_vision.py).

Qwen2-VL's, Qwen2.5-VL's and Qwen3-VL's image tokens take 2-D positions (multimodal
RoPE: time, row, column), and the text after them positions shifted from its index. Their
image prefix is prefilled with each layer's rotary embedding swapped for mlx-vlm's mRoPE at
those positions (``get_rope_index``); then every key kept is turned back by the shift (a
rotary embedding of one position for all: RoPE's scores depend on differences of positions
only), so every later token takes its plain index, as on any text model, on every engine
and path. Qwen3-VL's interleaved layout takes the same turn, and its deepstack features
are added to the first layers' outputs during that prefill (its MoE alike). GLM-4V's
mRoPE is refused by name. Gemma 4's language model (mlx-lm's) scales the embeddings it is
given and reads the ids beside them (per-layer inputs): its image prefix gets them
unscaled, its image tokens as padding, as mlx-vlm's does.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models.cache import KVCache

from schemas import InvalidRequestError
from worker.engine.images import Image, ImageCache
from worker.engine.kvquant import QuantizedKV
from worker.engine.prefill import PREFILL_STEP

log = logging.getLogger(__name__)

#: VLM architectures (config ``model_type``) whose images mlxq runs: checked equal to
#: mlx-vlm's own generation.
ARCHS = frozenset(
    {"gemma3", "mistral3", "idefics3", "smolvlm", "qwen2_vl", "qwen2_5_vl", "qwen3_vl"}
    | {"qwen3_vl_moe", "gemma4"}
)
#: VLMs whose checkpoints mlx-lm does not read as text models: their language model is
#: mlx-lm's ``text_config`` architecture over their language weights (:func:`load_language`).
TEXT_VIEWS = frozenset({"idefics3", "smolvlm"})
#: Architectures that position image tokens in 2-D (multimodal RoPE): not on mlx-lm's
#: language model.
MROPE = frozenset({"glm4v", "glm4v_moe"})
#: Those among :data:`ARCHS` whose image prefix is prefilled at mRoPE positions.
SHIFTED = frozenset({"qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe"})


@dataclass(frozen=True)
class VisionInput:
    """A prepared job's images: the processor's pixel arrays, where its last image token
    ends in the prompt, and the identity of its images (in order)."""

    arrays: dict[str, Any]  # pixel_values and any other per-image inputs of the processor
    end: int  # prompt tokens through the last image token
    digest: str  # SHA-256 over the images' own digests, in order
    first: int = 0  # where its first image token is (the text before it: any text prefix)


def can_see(config: dict[str, Any]) -> str | None:
    """Why a model's images cannot be run here (None: they can). A text-only model
    (no ``vision_config``) says so."""
    kind = config.get("model_type")
    if "vision_config" not in config:
        return "is a text model: it reads no images"
    if kind in MROPE:
        return f"is a {kind} model, whose images take 2-D positions (mRoPE): not run yet"
    if kind not in ARCHS:
        return f"is a {kind} model: mlxq runs images on {', '.join(sorted(ARCHS))} so far"
    try:
        import mlx_vlm  # noqa: F401
        import PIL  # noqa: F401
    except ImportError:
        return "needs mlx-vlm on the worker: pip install 'mlxq[vision]'"
    return None


class Vision:
    """A VLM's vision tower, projector and processor, beside its mlx-lm language model."""

    def __init__(self, model: nn.Module, processor: Any, image_token: int) -> None:
        self.model = model
        self.processor = processor
        self.image_token = image_token
        self.mrope = model.config.model_type in SHIFTED
        self.images = ImageCache()  # decoded images by content hash, for this model
        embed = {id(v) for _, v in tree_flatten(_embeddings_of(model).parameters())}
        own = [v for _, v in tree_flatten(model.parameters()) if id(v) not in embed]
        self.nbytes = sum(v.nbytes for v in own)  # beyond the language model's

    @classmethod
    def load(cls, path: Path, language: nn.Module) -> Vision:
        """mlx-vlm's model at ``path`` without its language model's layers, sharing
        ``language``'s (mlx-lm's) token embeddings; and its processor."""
        from mlx_vlm.utils import load_model, load_processor

        model = load_model(path, lazy=True)
        inner = _inner(model.language_model)
        inner.embed_tokens = _embeddings(language)
        inner.layers = []  # before anything is evaluated: never read from disk
        model.language_model.lm_head = nn.Identity()
        mx.eval(model.parameters())
        processor = load_processor(path, add_detokenizer=False)
        config = model.config
        token = getattr(config, "image_token_index", None) or config.image_token_id
        return cls(model, processor, int(token))

    def prepare(self, text: str, images: Sequence[Image]) -> tuple[list[int], VisionInput]:
        """The prompt's token ids (image placeholders expanded) and its image inputs."""
        from mlx_vlm.utils import prepare_inputs

        try:
            inputs = prepare_inputs(
                self.processor,
                images=[im.pixels for im in images],
                prompts=text,
                image_token_index=self.image_token,
            )
        except Exception as e:  # the processor refuses this prompt or these images
            raise InvalidRequestError(f"the model's processor refused the images: {e}") from e
        ids = [int(t) for t in inputs["input_ids"][0].tolist()]
        places = [i for i, t in enumerate(ids) if t == self.image_token]
        if len(places) == 0:
            raise InvalidRequestError(
                "the chat template placed no image in the prompt (it renders no image parts)"
            )
        end = places[-1] + 1
        if end >= len(ids):
            raise InvalidRequestError("the prompt ends with an image: nothing follows it")
        arrays = {k: v for k, v in inputs.items() if k not in ("input_ids",)}
        digest = hashlib.sha256("".join(im.digest for im in images).encode()).hexdigest()
        return ids, VisionInput(arrays, end, digest, places[0])

    def features(self, prompt: Sequence[int], vision: VisionInput) -> Any:
        """mlx-vlm's input features of ``prompt[:vision.end]``: ``inputs_embeds`` (1,
        tokens, hidden), and for some architectures more (Qwen3-VL's deepstack features
        and the positions they go to)."""
        ids = mx.array(list(prompt[: vision.end]))[None]
        arrays = dict(vision.arrays)
        pixels = arrays.pop("pixel_values", None)
        mask = arrays.pop("attention_mask", None)
        if mask is not None:
            mask = mask[:, : vision.end]
        return self.model.get_input_embeddings(ids, pixels, mask=mask, **arrays)

    def prefill(
        self,
        language: nn.Module,
        prompt: Sequence[int],
        vision: VisionInput,
        cache: list[Any],
        start: int = 0,
    ) -> list[Any]:
        """``cache`` (holding ``prompt[:start]``, text before the first image) holding
        ``prompt[:vision.end]``, images included: the language model run over the input
        embeddings in chunks of :data:`PREFILL_STEP`."""
        features = self.features(prompt, vision)
        embeds = features.inputs_embeds[0]
        tokens = mx.array(list(prompt[: vision.end]))
        ids = tokens
        if self.model.config.model_type == "gemma4":
            # mlx-lm's Gemma 4 scales what it is given (mlx-vlm's are scaled already), and
            # its per-layer inputs read the ids beside the embeddings: images' as padding.
            embeds = embeds / self.model.language_model.model.embed_scale
            ids = mx.where(tokens == self.image_token, 0, tokens)
        shift = 0
        with contextlib.ExitStack() as stack:
            if self.mrope:
                shift = stack.enter_context(self._positions(language, tokens, vision, cache))
            if getattr(features, "deepstack_visual_embeds", None) is not None:
                stack.enter_context(_deepstack(language, features))
            for i in range(start, vision.end, PREFILL_STEP):
                j = min(i + PREFILL_STEP, vision.end)
                # A slice each time: mlx-lm's models scale their input embeddings in place.
                language(ids[i:j][None], cache=cache, input_embeddings=embeds[i:j][None])
                mx.eval([c.state for c in cache])
        if shift:
            _turn_keys(cache, -shift, float(self.model.config.text_config.rope_theta))
        return cache

    def _rotary(self) -> Any:
        """mlx-vlm's mRoPE for the language model's attention (Qwen2's sections in
        chunks, Qwen3's interleaved)."""
        from mlx_vlm.models.qwen2_vl.language import Qwen2RotaryEmbedding
        from mlx_vlm.models.qwen3_vl.language import Qwen3VLRotaryEmbedding

        text = self.model.config.text_config
        dims = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        qwen3 = self.model.config.model_type in ("qwen3_vl", "qwen3_vl_moe")
        kind = Qwen3VLRotaryEmbedding if qwen3 else None
        return (kind or Qwen2RotaryEmbedding)(
            dims, text.max_position_embeddings, text.rope_theta, text.rope_scaling
        )

    @contextlib.contextmanager
    def _positions(
        self, language: nn.Module, tokens: mx.array, vision: VisionInput, cache: list[Any]
    ) -> Iterator[int]:
        """While the image prefix is prefilled: every layer's rotary embedding at mRoPE
        positions. Yields how far the text after it is shifted from its index."""
        if any(type(c) is not KVCache and not isinstance(c, QuantizedKV) for c in cache):
            raise InvalidRequestError(
                f"{self.model.config.model_type} images need full-attention KV caches"
            )
        grid = vision.arrays.get("image_grid_thw")
        positions, shift = self.model.language_model.get_rope_index(tokens[None], grid)
        rotary = self._rotary()
        attentions = [layer.self_attn for layer in language.layers]
        ropes = [a.rope for a in attentions]
        for a in attentions:
            a.rope = _AtPositions(rotary, positions)
        try:
            yield int(shift.reshape(-1)[0].item())
        finally:
            for a, rope in zip(attentions, ropes, strict=True):
                a.rope = rope


@contextlib.contextmanager
def _deepstack(language: nn.Module, features: Any) -> Iterator[None]:
    """While Qwen3-VL's image prefix is prefilled: layer i's output gets the tower's i-th
    deepstack features added at the image's positions (as mlx-vlm's language model adds
    them), for the tokens each call holds (from its cache's offset)."""
    where = features.visual_pos_masks[0].astype(mx.int32)
    index = mx.cumsum(where) - 1  # (which feature row each image position takes)
    layers = language.layers
    kept = list(layers)
    for i, rows in enumerate(features.deepstack_visual_embeds):
        extra = mx.where(where[:, None] > 0, rows[mx.maximum(index, 0)], 0).astype(rows.dtype)
        layers[i] = _Added(kept[i], extra)
    try:
        yield
    finally:
        layers[:] = kept


class _Added:
    """A decoder layer whose output gets ``extra[offset : offset + tokens]``."""

    def __init__(self, layer: Any, extra: mx.array) -> None:
        self.layer, self.extra = layer, extra

    def __call__(self, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
        start = int(cache.offset) if cache is not None else 0
        out = self.layer(x, mask, cache)
        return out + self.extra[start : start + x.shape[1]][None].astype(out.dtype)


class _AtPositions:
    """A layer's rotary embedding at given positions (mRoPE: (3, 1, tokens)), whatever the
    offset it is called with says, for the tokens from that offset on."""

    def __init__(self, rotary: Any, positions: mx.array) -> None:
        self.rotary, self.positions = rotary, positions

    def __call__(self, x: mx.array, offset: int = 0) -> mx.array:
        at = self.positions[..., offset : offset + x.shape[-2]]
        return self.rotary.apply_rotary(x, x, at)[0]  # type: ignore[no-any-return]


def _turn_keys(cache: list[Any], by: int, base: float) -> None:
    """Every key each layer holds turned by ``by`` positions (rotary, all alike). Quantized
    keys (``--kv-bits``) are turned dequantized and quantized again in their groups."""
    for c in cache:
        quantized = isinstance(c, QuantizedKV)
        if quantized:
            held = [x[..., : c.offset, :] for x in c.keys]
            keys = mx.dequantize(*held, group_size=c.group_size, bits=c.quant_bits)
        else:
            keys = c.keys[..., : c.offset, :]
        b, h, n, d = keys.shape
        turned = mx.fast.rope(
            keys.reshape(b * h * n, 1, d), d, traditional=False, base=base, scale=1.0, offset=by
        ).reshape(b, h, n, d)
        if quantized:
            again = mx.quantize(
                turned.astype(held[1].dtype), group_size=c.group_size, bits=c.quant_bits
            )
            for x, y in zip(c.keys, again, strict=True):
                x[..., : c.offset, :] = y
        else:
            c.keys[..., : c.offset, :] = turned
    mx.eval([c.state for c in cache])


def load_language(path: Path, config: dict[str, Any]) -> tuple[nn.Module, Any]:
    """The language model of a :data:`TEXT_VIEWS` VLM at ``path`` as an mlx-lm model of its
    ``text_config`` architecture (its weights under mlx-vlm's ``language_model.`` or
    Hugging Face's ``model.text_model.`` renamed, the vision tower's left on disk), and the
    tokenizer."""
    import importlib

    from mlx_lm.utils import MODEL_REMAPPING, load_model, load_tokenizer

    text = dict(config["text_config"])
    kind = str(text.get("model_type"))
    try:
        arch = importlib.import_module(f"mlx_lm.models.{MODEL_REMAPPING.get(kind, kind)}")
    except ImportError as e:
        raise ValueError(f"its language model ({kind}) is not an mlx-lm architecture") from e

    class Language(arch.Model):  # type: ignore[name-defined,misc]
        def sanitize(self, weights: dict[str, Any]) -> dict[str, Any]:
            return super().sanitize(_language_weights(weights))  # type: ignore[no-any-return]

    model, _ = load_model(
        path, model_config=text, get_model_classes=lambda config: (Language, arch.ModelArgs)
    )
    tokenizer = load_tokenizer(path, eos_token_ids=config.get("eos_token_id"))
    return model, tokenizer


#: Where a text-view VLM's language weights are (mlx-vlm's names, then Hugging Face's), and
#: what mlx-lm's model calls them.
_RENAMES = (
    ("language_model.lm_head.", "lm_head."),
    ("language_model.", "model."),
    ("model.text_model.", "model."),
    ("lm_head.", "lm_head."),
)


def _language_weights(weights: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for name, value in weights.items():
        for prefix, to in _RENAMES:
            if name.startswith(prefix):
                out[to + name[len(prefix) :]] = value
                break
    return out


def _inner(language: nn.Module) -> nn.Module:
    """mlx-vlm's language model's layers and embeddings: under ``model`` for most, on the
    language model itself for Idefics 3."""
    return language.model if "model" in language else language  # type: ignore[no-any-return]


def _embeddings_of(vlm: nn.Module) -> nn.Module:
    return _inner(vlm.language_model).embed_tokens  # type: ignore[no-any-return]


def _embeddings(language: nn.Module) -> nn.Module:
    """The token embedding layer of an mlx-lm model (a VLM's language model inside)."""
    inner = getattr(language, "language_model", language)
    return inner.model.embed_tokens  # type: ignore[no-any-return]
