"""The model cache: each model loaded once, shared by every job and draft pairing, LRU-evicted.

Models are cached individually (not per target/draft pair), so a target used
alone, with draft A and with draft B is loaded once. A LoRA adapter entry
shares its base model's weight arrays (MLX arrays are immutable buffers) and
adds only the adapter's own parameters, so the base stays untouched for other
jobs. Under a memory budget, least-recently-used models are evicted and memory
is freed *before* the next model is loaded. Kept prompt prefixes
(``worker.engine.prefix``) count in the same budget: they are evicted before any
model, and a model's prefixes go with it.
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.models.cache import KVCache

from schemas import (
    ContextTooLargeError,
    IncompatibleDraftError,
    MlxqError,
    ModelLoadError,
    ModelNotFoundError,
    ModelTooLargeError,
)
from schemas.request import MAX_IMAGE_BYTES
from worker.engine.drafters import MTP, drafter_type
from worker.engine.embed import Embedder, pooling_of
from worker.engine.encoder import ENCODER_TYPES, encoder_tokenizer, load_encoder
from worker.engine.group import RANK0, Group, PrefixTeller, load_sharded
from worker.engine.heads import kv_profile as drafter_kv
from worker.engine.heads import load as load_drafter
from worker.engine.identity import weights_identity
from worker.engine.kvquant import KVQuant, QuantizedKV, describe, make_cache, probe
from worker.engine.memory import (
    DEVICE_SHARE,
    KVProfile,
    default_budget,
    device_memory,
    kv_profile,
)
from worker.engine.prefix import PrefixCache
from worker.engine.prefixdisk import PrefixDisk
from worker.engine.rewind import leaves
from worker.engine.vision import TEXT_VIEWS, Vision, can_see, load_language
from worker.engine.whisper import is_whisper, load_whisper, whisper_dtype

log = logging.getLogger(__name__)

#: The cache name of a target's own MTP head(s): the target's name, then this.
MTP_OF = "#" + MTP

#: Files fetched for a hub model. No ``*.py``: mlxq never runs remote code.
HUB_PATTERNS = [
    "*.json",
    "*.safetensors",
    "tokenizer.model",
    "*.tiktoken",
    "tiktoken.model",
    "*.txt",
    "*.jsonl",
    "*.jinja",
]

CacheKey = tuple[str, str | None]

#: Default byte budget of the prefix cache (``--prefix-cache-gb``).
DEFAULT_PREFIX_CACHE_BYTES = 1_000_000_000


@dataclass
class LoadedModel:
    """A model (optionally with a LoRA adapter) held in memory with its tokenizer."""

    name: str
    adapter: str | None
    model: nn.Module
    tokenizer: Any
    config: dict[str, Any]
    nbytes: int
    load_time_s: float
    pinned: bool = False
    uses: int = 0
    _vocab: dict[str, int] | None = field(default=None, repr=False)
    _kv: KVProfile | None = field(default=None, repr=False)
    _plain_kv: bool | None = field(default=None, repr=False)
    #: How it embeds, for an embedding model (None: a chat model).
    embedder: Embedder | None = field(default=None, repr=False)
    #: How its KV caches are quantized (None: not; ``worker --kv-bits``).
    kv_quant: KVQuant | None = None
    #: Its vision tower, for a vision-language model that runs images here; else why not.
    vision: Vision | None = field(default=None, repr=False)
    no_vision: str | None = None
    #: Held whole by a worker group's rank 0 alone (a draft), not split across the group.
    local: bool = False
    #: Drafters bound to it as a target, by name (``worker.engine.drafters.Head``).
    drafters: dict[str, Any] = field(default_factory=dict, repr=False)

    def new_cache(self) -> list[Any]:
        """An empty cache for one sequence, as every engine makes them (quantized KV
        layers under ``--kv-bits``)."""
        return make_cache(self.model, self.kv_quant)

    @property
    def kv_bits(self) -> int | None:
        """The bits its full-attention KV caches hold (None: unquantized)."""
        return self.kv_quant.bits if self.kv_quant is not None else None

    @property
    def kind(self) -> str:
        """What jobs it serves: "chat", "embeddings" or "audio" (a Whisper checkpoint);
        "drafter" for a head proposing for a target (EAGLE-3, MTP, DFlash), not a model alone."""
        if self.embedder is not None:
            return "embeddings"
        if drafter_type(self.config) is not None:
            return "drafter"
        return "audio" if is_whisper(self.config) else "chat"

    @property
    def key(self) -> CacheKey:
        return (self.name, RANK0 if self.local else self.adapter)

    @property
    def context_length(self) -> int | None:
        """The model's context window in tokens, when its config states one."""
        for name in ("max_position_embeddings", "max_sequence_length", "n_positions"):
            value = self.config.get(name) or self.config.get("text_config", {}).get(name)
            if value:
                return int(value)
        return None

    @property
    def vocab_size(self) -> int:
        """Rows of the model's output layer (its config's ``vocab_size``, else the tokenizer's)."""
        return int(self.config.get("vocab_size") or len(self.vocab()))

    @property
    def kv(self) -> KVProfile:
        """The model's KV-cache bytes per sequence (measured once, ``worker.engine.memory``)."""
        if self._kv is None:
            self._kv = kv_profile(self.model, self.new_cache())
        return self._kv

    @property
    def plain_kv(self) -> bool:
        """Whether every layer's cache is a plain KV cache (no sliding window, no recurrent
        state): rewound by cutting positions off, and a kept prefix serves any shorter one.
        Found once, from an empty cache of the model."""
        if self._plain_kv is None:
            cache = leaves(self.new_cache())
            self._plain_kv = all(type(c) in (KVCache, QuantizedKV) for c in cache)
        return self._plain_kv

    def vocab(self) -> dict[str, int]:
        """The tokenizer's token -> id map (computed once)."""
        if self._vocab is None:
            self._vocab = dict(self.tokenizer.get_vocab())
        return self._vocab


def resolve_path(name: str) -> Path:
    """A local directory for ``name``: the path itself, or the hub snapshot (HF_HOME cache).

    Honours HF_HOME and HF_HUB_OFFLINE through huggingface-hub.
    """
    path = Path(name).expanduser()
    if path.exists():
        if not path.is_dir():
            gguf = path.suffix.lower() == ".gguf"
            hint = " (import a GGUF file first: worker import-gguf FILE OUT)" if gguf else ""
            raise ModelNotFoundError(f"model {name!r} is a file, not a model directory{hint}")
        return path
    if name.startswith(("/", "./", "../", "~")):
        raise ModelNotFoundError(f"model {name!r}: no such local directory")
    return hub_snapshot(name)


def hub_snapshot(name: str) -> Path:
    """The local snapshot of hub repository ``name`` (fetched once into the HF cache)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError

    try:
        return Path(snapshot_download(name, allow_patterns=HUB_PATTERNS))
    except HFValidationError:
        raise ModelNotFoundError(
            f"model {name!r} is neither a local directory nor a valid hub repository id"
        ) from None
    except Exception as e:
        raise ModelNotFoundError(
            f"model {name!r} could not be fetched from the hub "
            f"({type(e).__name__}; offline or unknown repository?)"
        ) from None


def cached_snapshot(name: str) -> Path | None:
    """The local snapshot of hub repository ``name`` if the HF cache holds it, else None
    (never downloads)."""
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(name, allow_patterns=HUB_PATTERNS, local_files_only=True))
    except Exception:  # not cached, not a repository id: nothing local
        return None


def local_dir(name: str) -> Path | None:
    """The directory ``name`` loads from if it is on this machine already, else None (a
    hub repository not fetched yet): what can be read without downloading."""
    path = Path(name).expanduser()
    if path.is_dir():
        return path
    if path.exists() or name.startswith(("/", "./", "../", "~")):
        return None
    return cached_snapshot(name)


def weight_bytes(path: Path) -> int:
    """Bytes of the weight files in a model or adapter directory (what loading will cost)."""
    return sum(f.stat().st_size for f in path.glob("*.safetensors"))


def param_bytes(model: nn.Module) -> int:
    return sum(v.nbytes for _, v in tree_flatten(model.parameters()))


def free_memory() -> None:
    """Return freed MLX buffers to the system (called after eviction, before loading)."""
    gc.collect()
    mx.clear_cache()


class ModelCache:
    """Loaded models keyed by (name, adapter), with an LRU memory budget."""

    def __init__(
        self,
        budget_bytes: int | None = None,
        prefix_bytes: int = DEFAULT_PREFIX_CACHE_BYTES,
        locate: Callable[[str], Path] = resolve_path,
        prefix_disk: PrefixDisk | None = None,
        kv_quant: KVQuant | None = None,
        group: Group | None = None,
        max_image_bytes: int = MAX_IMAGE_BYTES,
    ) -> None:
        self.budget_bytes = budget_bytes
        #: ``--max-image-mb``: the largest image a job may show.
        self.max_image_bytes = max_image_bytes
        #: ``--shard``: each model split across a worker group's ranks (``worker.engine.group``).
        self.group = group
        #: ``--kv-bits``: chat models whose attention takes quantized caches use them.
        self.kv_quant = kv_quant
        #: Name -> directory to load from (``worker.runner.access`` restricts it).
        self.locate = locate
        self.prefixes = PrefixCache(prefix_bytes, prefix_disk)
        if group is not None and group.leads:  # the other ranks keep their parts too
            self.prefixes.mirror = PrefixTeller(group)
        self._entries: OrderedDict[CacheKey, LoadedModel] = OrderedDict()
        self._compatible: dict[tuple[CacheKey, CacheKey], bool] = {}
        self.loads = 0
        self.evictions = 0
        #: KV-cache bytes the running job or batch may still grow to: kept prefixes
        #: do not take that room. Written only by :meth:`reserve` and :meth:`release`.
        self.kv_reserved = 0

    def __contains__(self, key: CacheKey) -> bool:
        return key in self._entries

    def loaded_models(self) -> list[str]:
        """The names of the models loaded (as jobs name them), each once."""
        return list(dict.fromkeys(name for name, _ in self._entries))

    @property
    def model_bytes(self) -> int:
        return sum(e.nbytes for e in self._entries.values())

    @property
    def used_bytes(self) -> int:
        """Models and kept prefixes: what counts against the budget."""
        return self.model_bytes + self.prefixes.nbytes

    def prefix_room(self) -> int:
        """Bytes the prefix cache may still add under this cache's budget."""
        if self.budget_bytes is None:
            return self.prefixes.budget_bytes
        return self.budget_bytes - self.used_bytes - self.kv_reserved

    @property
    def limit_bytes(self) -> int:
        """The memory this worker plans with: the budget, else a share of the device's."""
        return self.budget_bytes if self.budget_bytes is not None else default_budget()

    def kv_room(self) -> int:
        """Bytes left for KV caches of running sequences after models and kept prefixes."""
        return self.limit_bytes - self.used_bytes

    def check_kv_fits(self, needed: int, what: str) -> None:
        """Raise :class:`ContextTooLargeError`, naming the numbers, if ``needed`` KV bytes
        do not fit even with no other job running and no prefix kept."""
        room = self.limit_bytes - self.model_bytes
        if needed <= room:
            return
        budget = (
            f"--cache-gb {self.budget_bytes / 1e9:g}"
            if self.budget_bytes is not None
            else f"{DEVICE_SHARE:.0%} of this device's {device_memory() / 1e9:.1f} GB"
        )
        raise ContextTooLargeError(
            f"{what} needs {needed / 1e6:,.2f} MB of KV cache, but the memory budget "
            f"({self.limit_bytes / 1e6:,.2f} MB: {budget}) leaves {max(room, 0) / 1e6:,.2f} MB "
            f"after the loaded models ({self.model_bytes / 1e6:,.2f} MB)"
        )

    def make_kv_room(self, needed: int, what: str) -> int:
        """Room for ``needed`` KV bytes of a job running on its own, evicting kept prefixes
        if that makes it fit (else :meth:`check_kv_fits` raises). Returns the room."""
        self.check_kv_fits(needed, what)
        room = self.kv_room()
        if needed > room and self.prefixes.evict(needed - room):
            free_memory()
            room = self.kv_room()
        return room

    def reserve(self, nbytes: int) -> None:
        """The running job or batch may grow its KV caches to ``nbytes`` (kept prefixes
        keep out of that room)."""
        self.kv_reserved = nbytes

    def release(self) -> None:
        """The running job or batch has ended: its KV room is free."""
        self.kv_reserved = 0

    @contextmanager
    def reserving(self, nbytes: int, what: str) -> Iterator[None]:
        """Room for a job running on its own (:meth:`make_kv_room`), reserved while it runs,
        on top of what a paused batch holds (a job run between its steps)."""
        held = self.kv_reserved
        self.make_kv_room(held + nbytes, what)
        self.reserve(held + nbytes)
        try:
            yield
        finally:
            self.reserve(held)

    def fits_beside(self, nbytes: int) -> bool:
        """Whether ``nbytes`` more KV cache fit beside what is reserved, once kept prefixes
        are evicted (a job run between a batch's steps must, or it waits)."""
        return self.short_beside(nbytes) <= 0

    def short_beside(self, nbytes: int) -> int:
        """The bytes missing for ``nbytes`` more KV cache beside what is reserved (<= 0:
        it fits, as :meth:`fits_beside` says)."""
        return self.kv_reserved + nbytes - (self.limit_bytes - self.model_bytes)

    def entries(self) -> list[LoadedModel]:
        """Loaded models, least recently used first."""
        return list(self._entries.values())

    def get(
        self,
        name: str,
        adapter: str | None = None,
        *,
        keep: tuple[CacheKey, ...] = (),
        pin: bool = False,
        local: bool = False,
    ) -> tuple[LoadedModel, bool]:
        """The loaded model and whether it was already warm. ``keep`` entries are not evicted.
        ``local``: in a worker group, loaded whole on this rank alone (rank 0's draft: no
        other rank runs it), not split."""
        local = local and self.group is not None
        if local and adapter is not None:
            raise ModelLoadError(f"adapter {adapter!r}: a worker group serves no adapters yet")
        key = (name, RANK0 if local else adapter)
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
            entry.uses += 1
            entry.pinned = entry.pinned or pin
            return entry, True
        if local:
            entry = self._load_base(name, keep, local=True)
        elif adapter is None:
            with self._watch(f"loading {name!r}", 10):  # (every rank loads its part)
                entry = self._load_base(name, keep)
        elif self.group is not None:
            raise ModelLoadError(f"adapter {adapter!r}: a worker group serves no adapters yet")
        else:
            base, _ = self.get(name, None, keep=keep)
            entry = self._load_adapter(base, adapter, keep=(*keep, base.key))
        entry.pinned = pin
        entry.uses = 1
        if self.kv_quant is not None and entry.kind == "chat":
            self._quantize(entry)
        if self.group is not None and not local:  # measured now, on every rank (a forward pass)
            with self._watch(f"measuring {name!r}"):
                _ = entry.kv
        self._entries[key] = entry
        self.loads += 1
        if self.prefixes.disk is not None and entry.kind == "chat":
            self._identify(entry)
        return entry, False

    def _quantize(self, entry: LoadedModel) -> None:
        """Give ``entry`` quantized KV caches if its attention takes them (else it runs
        unquantized, said once in the log; its records say so too)."""
        assert self.kv_quant is not None
        why = probe(entry.model, self.kv_quant)
        if why is None:
            entry.kv_quant = self.kv_quant
            log.info("%s: KV caches: %s", _label(entry.key), describe(entry.new_cache()))
        else:
            log.warning("%s: KV caches stay unquantized: %s", _label(entry.key), why)

    def _identify(self, entry: LoadedModel) -> None:
        """Give the prefix cache ``entry``'s weights identity (its base's and its
        adapter's): its kept prefixes then go to disk and come back from it."""
        try:
            identity = weights_identity(self.locate(entry.name))
            if entry.adapter is not None:
                identity += "+" + weights_identity(self.locate(entry.adapter))
            if entry.kv_quant is not None:  # its files hold quantized layers
                identity += "+" + entry.kv_quant.tag
        except Exception as e:  # unreadable: this model's prefixes stay in memory
            log.warning("prefix cache on disk: %s stays in memory (%s)", entry.name, e)
            return
        self.prefixes.identify(entry.key, identity)

    def _make_room(self, needed: int, keep: tuple[CacheKey, ...], what: str) -> None:
        if self.budget_bytes is None:
            return
        if needed > self.budget_bytes:
            raise ModelTooLargeError(
                f"{what} needs {needed / 1e9:.2f} GB, more than the worker's cache budget of "
                f"{self.budget_bytes / 1e9:.2f} GB (--cache-gb)"
            )
        evicted = False
        over = self.used_bytes + needed - self.budget_bytes
        if over > 0 and self.prefixes.evict(over):  # kept prefixes go before any model
            evicted = True
        for key in list(self._entries):
            if self.used_bytes + needed <= self.budget_bytes:
                break
            entry = self._entries[key]
            if entry.pinned or key in keep:
                continue
            self._evict(key)
            evicted = True
        if self.used_bytes + needed > self.budget_bytes:
            raise ModelTooLargeError(
                f"{what} needs {needed / 1e9:.2f} GB but only "
                f"{(self.budget_bytes - self.used_bytes) / 1e9:.2f} GB of the cache budget can be "
                "freed (the rest is pinned or in use by this job)"
            )
        if evicted:
            free_memory()

    def _watch(self, what: str, factor: float = 1.0) -> contextlib.AbstractContextManager[None]:
        """A call into the worker group that must return in time (``Group.call``)."""
        return self.group.call(what, factor) if self.group else contextlib.nullcontext()

    def evict(self, key: CacheKey) -> None:
        """Unload ``key`` (and its adapters) if it is loaded."""
        if key in self._entries:
            self._evict(key)
            free_memory()

    def _evict(self, key: CacheKey) -> None:
        # Adapter entries share their base's arrays: evicting a base evicts its adapters.
        adapted = [k for k in self._entries if k[0] == key[0] and k[1] not in (None, RANK0)]
        dependents = adapted if key[1] is None else []
        if self.group is not None and key[1] != RANK0:  # (rank 0's own draft: no one else has it)
            with self._watch(f"evicting {key[0]!r}"):
                self.group.tell({"op": "evict", "name": key[0], "adapter": key[1]})
        for k in [*dependents, key]:
            entry = self._entries.pop(k)
            self.prefixes.drop_model(k)
            self.evictions += 1
            self._compatible = {p: v for p, v in self._compatible.items() if k not in p}
            log.info("evicted %s (%.1f MB)", _label(k), entry.nbytes / 1e6)

    def evict_all(self) -> None:
        for key in list(self._entries):
            if key in self._entries:
                self._evict(key)
        free_memory()

    def _load_base(self, name: str, keep: tuple[CacheKey, ...], local: bool = False) -> LoadedModel:
        mtp = name.endswith(MTP_OF)  # a target's own MTP head(s), from its checkpoint
        path = self.locate(name.removesuffix(MTP_OF))
        if not (path / "config.json").exists():
            raise ModelNotFoundError(f"model {name!r}: {path} has no config.json")
        self._make_room(0 if mtp else weight_bytes(path), keep, f"model {name!r}")
        start = time.perf_counter()
        split = self.group is not None and not local
        if split:
            _chat_only(path, name)
            self.group.tell({"op": "load", "name": name, "adapter": None})
        try:
            if split:
                model, tokenizer, config = load_sharded(path, self.group, name)
                embedder = None
            else:
                model, tokenizer, config, embedder = _load(path, mtp)
        except MlxqError:
            raise
        except Exception as e:
            raise ModelLoadError(f"model {name!r} could not be loaded: {e}") from e
        elapsed = time.perf_counter() - start
        entry = LoadedModel(name, None, model, tokenizer, config, param_bytes(model), elapsed)
        entry.embedder, entry.local = embedder, local
        if entry.kind == "drafter":  # (its caches are the engine's, not an mlx-lm model's)
            entry._kv = drafter_kv(model)
        if entry.kind == "chat":
            self._see(entry, path)
        log.info(
            "loaded %s in %.2fs (%.1f MB)",
            _label(entry.key) + ("" if entry.kind == "chat" else f" ({entry.kind})"),
            elapsed,
            entry.nbytes / 1e6,
        )
        return entry

    def _see(self, entry: LoadedModel, path: Path) -> None:
        """Load ``entry``'s vision tower if it is a VLM whose images run here."""
        entry.no_vision = can_see(entry.config)
        if self.group is not None and entry.no_vision is None:
            entry.no_vision = "runs on a worker group: images are not run there yet"
        if entry.no_vision is not None:
            return
        try:
            entry.vision = Vision.load(path, entry.model)
        except Exception as e:
            raise ModelLoadError(f"model {entry.name!r}: its vision tower: {e}") from e
        entry.vision.images.max_bytes = self.max_image_bytes
        entry.nbytes += entry.vision.nbytes
        log.info("%s reads images (vision tower %.1f MB)", entry.name, entry.vision.nbytes / 1e6)

    def _load_adapter(
        self, base: LoadedModel, adapter: str, keep: tuple[CacheKey, ...]
    ) -> LoadedModel:
        from mlx_lm.tuner.utils import load_adapters
        from mlx_lm.utils import load_model

        path = self.locate(adapter)
        if not (path / "adapter_config.json").exists():
            raise ModelNotFoundError(f"adapter {adapter!r}: {path} has no adapter_config.json")
        self._make_room(weight_bytes(path), keep, f"adapter {adapter!r}")
        start = time.perf_counter()
        try:
            # A lazy skeleton of the base, given the base's (already loaded, shared) arrays.
            model, _ = load_model(self.locate(base.name), lazy=True)
            model.update(tree_unflatten(tree_flatten(base.model.parameters())))
            before = {k for k, _ in tree_flatten(model.parameters())}
            model = load_adapters(model, str(path))
            model.eval()
            own = [v for k, v in tree_flatten(model.parameters()) if k not in before]
            mx.eval(own)
        except Exception as e:
            raise ModelLoadError(
                f"adapter {adapter!r} could not be applied to {base.name!r}: {e}"
            ) from e
        elapsed = time.perf_counter() - start
        nbytes = sum(v.nbytes for v in own)
        entry = LoadedModel(base.name, adapter, model, base.tokenizer, base.config, nbytes, elapsed)
        entry.vision, entry.no_vision = base.vision, base.no_vision  # its images, on the base
        return entry

    def check_draft(self, target: LoadedModel, draft: LoadedModel) -> None:
        """Raise :class:`IncompatibleDraftError` unless both tokenizers have the same vocabulary."""
        pair = (target.key, draft.key)
        if pair not in self._compatible:
            self._compatible[pair] = target.vocab() == draft.vocab()
        if not self._compatible[pair]:
            t, d = target.vocab(), draft.vocab()
            differ = sum(1 for tok, i in t.items() if d.get(tok) != i) + len(d.keys() - t.keys())
            raise IncompatibleDraftError(
                f"draft model {draft.name!r} cannot be used with {target.name!r}: their tokenizers "
                f"differ ({len(t)} vs {len(d)} tokens, {differ} entries differ)"
            )


def _load(path: Path, mtp: bool = False) -> tuple[nn.Module, Any, dict[str, Any], Embedder | None]:
    """Model, tokenizer, config and, for an embedding model, its embedder: an encoder
    (``worker.engine.encoder``), or an mlx-lm decoder with a sentence-transformers pooling
    module; a drafter (``mtp``: the MTP head(s) in the checkpoint) through mlx-vlm's
    loader; any other model is a chat model, loaded by mlx-lm."""
    from mlx_lm.utils import load

    config, encoder, pooling = _kind(path)
    if mtp or drafter_type(config) is not None:  # (mlx-vlm's loader runs no model code)
        module, config = load_drafter(path, mtp)
        return module, None, config, None
    if is_whisper(config):  # mlx-whisper's format; its tokenizer ships with mlx-whisper
        return load_whisper(path, whisper_dtype()), None, config, None
    if not encoder and (why := _remote_only(config)) is not None:
        raise ValueError(why)
    if encoder:
        assert pooling is not None
        model = load_encoder(path, config)
        tokenizer = encoder_tokenizer(path)
    elif config.get("model_type") in TEXT_VIEWS:  # (a VLM mlx-lm does not read as text)
        model, tokenizer = load_language(path, config)
    else:
        model, tokenizer, config = load(str(path), return_config=True)
    if pooling is None:
        return model, tokenizer, config, None
    return model, tokenizer, config, Embedder(model, tokenizer, pooling, config, not encoder)


def _remote_only(config: dict[str, Any]) -> str | None:
    """Why a model whose architecture only its own remote code defines (``auto_map``, e.g.
    nomic-bert) cannot load: mlxq never runs a model's code. None if mlx-lm has it."""
    import importlib.util

    from mlx_lm.utils import MODEL_REMAPPING

    kind = str(config.get("model_type", "?"))
    if not config.get("auto_map"):
        return None
    known = MODEL_REMAPPING.get(kind, kind).replace("-", "_")
    if known.isidentifier() and importlib.util.find_spec(f"mlx_lm.models.{known}") is not None:
        return None
    return (
        f"model_type {kind!r} is defined only by the model's own code (auto_map), which mlxq "
        "never runs; neither mlxq nor mlx-lm implements it"
    )


def _kind(path: Path) -> tuple[dict[str, Any], bool, Any]:
    """A model directory's config, whether it is an encoder, and its pooling (None: a
    chat model)."""
    config = json.loads((path / "config.json").read_text())
    encoder = config.get("model_type") in ENCODER_TYPES
    return config, encoder, pooling_of(path, config, encoder)


def _chat_only(path: Path, name: str) -> None:
    """A worker group splits chat models only: an embedding or audio model fails by name."""
    config, _, pooling = _kind(path)
    if pooling is not None or is_whisper(config):
        what = "embeds" if pooling is not None else "transcribes audio"
        raise ModelLoadError(f"model {name!r} {what}: a worker group serves chat models only")


def _label(key: CacheKey) -> str:
    if key[1] == RANK0:
        return f"{key[0]} (whole, on rank 0 alone)"
    return key[0] if key[1] is None else f"{key[0]} + adapter {key[1]}"
