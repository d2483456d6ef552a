"""The prefix cache: KV state of shared prompt prefixes, kept across jobs.

Batch jobs are usually one long shared instruction (a system prompt, few-shot
turns) and a short item. The KV state of that shared part is the same for
every job on the same (model, adapter), so it is computed once and kept: a
job whose prompt starts with a kept prefix prefills only the rest.

- **What is kept.** The part of a job's prompt that other jobs' prompts share, on
  token ids, whatever the chat template does with the messages: the longest start
  that a recent prompt of the same (model, adapter) also began with
  (:meth:`PrefixCache.shared`: chained hashes of :data:`BLOCK`-token blocks of
  recent prompts, as vLLM's automatic prefix caching, then exact; a shared system
  prompt, few-shot turns, or a document at the head of a single user message). A
  job that shares nothing known yet is compared with the jobs queued right after it
  (``company``, from the runner), and its last message boundary (every message but
  the last, as the template renders them) is a hint: so the first job of a group
  keeps what the group shares, and a batch queued at once prefills it once. Each
  must be at least :data:`MIN_TOKENS` long. If no entry covers it yet, it is prefilled on its own
  first (from the longest entry that covers part of it) and kept; the job, and
  every later job sharing it, starts from a copy. A prompt no other job shares
  (and without a boundary hint) makes no entry.
- **Matching.** On token ids: the longest common prefix of the prompt with any
  kept entry of the model (trimmed to it), always leaving at least one token to
  prefill. On KV layers any common prefix is reusable, not only whole messages:
  the KV of the first n tokens depends on those tokens alone. Recurrent state
  (linear attention, SSM) and a sliding window that has wrapped hold exactly
  their entry's tokens, so such an entry serves a prompt that starts with all of
  them (``worker.engine.layers``).
- **Disk.** With ``--prefix-cache-dir``, entries are also written to disk and a new or
  restarted worker on the machine reads them back (``worker.engine.prefixdisk``).
- **A worker group** (``worker --shard``): each rank holds its part of every entry of a
  split model. Rank 0 decides; its :attr:`PrefixCache.mirror` tells the other ranks
  each prefill of an entry (they run the same one: it is a collective) and each entry
  it forgets, and a job starts on every rank from the same entry
  (``worker.engine.mirror``).
- **Memory.** Entries are compact copies (exactly their tokens' state, a
  sliding window's at most its window, not the generation buffer), counted in
  bytes under the cache's own budget (``--prefix-cache-gb``) and inside the
  model cache's (``--cache-gb``): least recently used entries go first, before a
  model load would fail, and all of a model's entries go with the model.

mlx-lm's server has ``LRUPromptCache`` (a trie; deep copies on fetch). It is
not used here because mlxq needs what it does not offer: dropping a model's
entries with the model, evicting for the model cache's budget, hit counts,
zero-copy reuse, and warming a prefix before a job runs.
"""

from __future__ import annotations

import contextlib
import logging
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import mlx.nn as nn
import numpy as np

from worker.engine.layers import nbytes as cache_nbytes
from worker.engine.layers import restore, shortest, snapshot
from worker.engine.prefill import prefill
from worker.engine.prefixdisk import PrefixDisk


class Runs(Protocol):
    """A loaded model as the prefix cache needs it (``worker.engine.models.LoadedModel``)."""

    model: nn.Module

    def new_cache(self) -> list[Any]: ...


class Mirror(Protocol):
    """Where a worker group's rank 0 tells its other ranks what its prefix cache does with
    a split model's entries (``worker.engine.mirror.PrefixTeller``)."""

    def prefilling(
        self, model: Hashable, tokens: Sequence[int], base: tuple[int, ...] | None, held: int
    ) -> contextlib.AbstractContextManager[None]:
        """Around the prefill of entry ``tokens`` of ``model``, from the first ``held``
        tokens of entry ``base`` (None: from nothing)."""
        ...

    def forgot(self, model: Hashable, tokens: tuple[int, ...]) -> None:
        """Entry ``tokens`` of ``model`` is gone."""
        ...


log = logging.getLogger(__name__)

#: Prefixes shorter than this are not worth an entry (tokens).
MIN_TOKENS = 32
#: Prompts are compared in blocks of this many tokens (a shared part is found to the
#: last whole block both prompts have).
BLOCK = 16
#: Block hashes of recent prompts remembered, least recently seen dropped first: about
#: a million tokens of prompts (~10 MB with the prompts they point to), across models.
RECENT_BLOCKS = 65536

Cache = list[Any]


@dataclass
class Entry:
    """A kept prefix: its tokens and one compact cache per layer (``worker.engine.layers``);
    ``shortest``: the fewest of its tokens a job may start from (all of them when a
    layer's state cannot be cut: recurrent, or a sliding window that has wrapped)."""

    tokens: tuple[int, ...]
    layers: Cache
    nbytes: int
    shortest: int = 1

    def usable(self, n: int) -> bool:
        return n >= self.shortest


@dataclass
class PrefixStats:
    """How often the prefix cache served (``producer fleet`` shows it with its size)."""

    lookups: int = 0
    hits: int = 0
    tokens_reused: int = 0
    disk_hits: int = 0  # entries loaded from disk (``--prefix-cache-dir``)


def block_hashes(prompt: Sequence[int]) -> list[int]:
    """One hash per whole :data:`BLOCK` of ``prompt``, each over the block and the hash
    before it: equal hashes at block i mean equal prompts up to block i's end (bar a
    64-bit collision, which costs only a prefill: entries match on the tokens)."""
    out, h = [], 0
    for i in range(0, len(prompt) - BLOCK + 1, BLOCK):
        h = hash((h, *prompt[i : i + BLOCK]))
        out.append(h)
    return out


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class PrefixCache:
    """Kept prefixes of every model, least recently used first, under a byte budget; also
    on ``disk`` (``worker.engine.prefixdisk``) for the models given an identity."""

    def __init__(self, budget_bytes: int, disk: PrefixDisk | None = None) -> None:
        self.budget_bytes = max(0, int(budget_bytes))
        self.disk = disk
        self._ids: dict[Hashable, str] = {}  # model -> its weights' identity (disk only)
        self._entries: OrderedDict[tuple[Hashable, tuple[int, ...]], Entry] = OrderedDict()
        self._nbytes = 0  # kept up to date, so other threads can read it (fleet registry)
        self.stats = PrefixStats()
        # (model, block hash) -> the last prompt that had that block (its tokens).
        self._seen: OrderedDict[tuple[Hashable, int], np.ndarray] = OrderedDict()
        #: A worker group's rank 0: the other ranks are told of each prefill and removal.
        self.mirror: Mirror | None = None

    @property
    def enabled(self) -> bool:
        return self.budget_bytes > 0

    @property
    def nbytes(self) -> int:
        return self._nbytes

    def __len__(self) -> int:
        return len(self._entries)

    def entries(self) -> list[Entry]:
        """Kept entries, least recently used first."""
        return list(self._entries.values())

    def shared(self, model: Hashable, prompt: Sequence[int]) -> int:
        """How many leading tokens of ``prompt`` a prompt of ``model`` seen before
        (:meth:`remember`) also began with: found by whole blocks, then counted exactly
        against the last prompt that had the deepest block."""
        other = None
        for h in block_hashes(prompt):
            seen = self._seen.get((model, h))
            if seen is None:
                break
            other = seen
        if other is None:
            return 0
        n = min(len(other), len(prompt))
        differ = np.flatnonzero(other[:n] != np.asarray(prompt[:n], dtype=np.int64))
        return int(differ[0]) if differ.size else n

    def remember(self, model: Hashable, prompt: Sequence[int]) -> None:
        """Note ``prompt``'s blocks for the prompts after it (the oldest are forgotten)."""
        tokens = np.asarray(prompt, dtype=np.int64)  # one copy, shared by its blocks
        for h in block_hashes(prompt):
            self._seen[(model, h)] = tokens
            self._seen.move_to_end((model, h))
        while len(self._seen) > RECENT_BLOCKS:
            self._seen.popitem(last=False)

    def match(self, model: Hashable, prompt: Sequence[int]) -> tuple[Entry, int] | None:
        """The entry of ``model`` sharing the longest prefix with ``prompt``, and its length."""
        best, best_n = None, 0
        for (owner, _), entry in self._entries.items():
            if owner != model:
                continue
            n = common_prefix(entry.tokens, prompt)
            if n > best_n and entry.usable(n):
                best, best_n = entry, n
        if best is None:
            return None
        self._entries.move_to_end((model, best.tokens))
        return best, best_n

    def identify(self, model: Hashable, identity: str) -> None:
        """``model``'s weights identity: its entries are written to and read from disk."""
        self._ids[model] = identity

    def from_disk(self, model: Hashable, net: Runs, prompt: Sequence[int], room: int) -> None:
        """Bring the longest entry on disk that ``prompt`` begins with into memory, if it
        gives at least :data:`MIN_TOKENS` more than memory holds (``net``: the model, whose
        caches the file's layers must be; ``room``: as :meth:`put`)."""
        identity = self._ids.get(model)
        if self.disk is None or identity is None or not self.enabled:
            return
        found = self.disk.longest(identity, prompt)
        if found is None:
            return
        matched = self.match(model, prompt)
        if matched is not None and len(found.tokens) - matched[1] < MIN_TOKENS:
            return
        layers = self.disk.load(found, net.new_cache())
        if layers is not None and self.put(model, found.tokens, layers, room, write=False):
            self.stats.disk_hits += 1

    def put(
        self, model: Hashable, tokens: Sequence[int], layers: Cache, room: int, write: bool = True
    ) -> bool:
        """Keep ``layers`` (the KV state of exactly ``tokens``) if it fits: within the cache's
        budget and within ``room`` bytes more than it holds now (what the model cache can
        spare). Older entries go first to make space; True if it was kept."""
        nbytes = cache_nbytes(layers)
        limit = min(self.budget_bytes, self.nbytes + max(room, 0))
        if nbytes > limit:
            return False
        key = (model, tuple(tokens))
        if key in self._entries:
            self._entries.move_to_end(key)
            return True
        # Shorter entries of the model that this one extends are redundant now.
        for k in [k for k in self._entries if k[0] == model and k[1] == key[1][: len(k[1])]]:
            self._remove(k)
        while self._entries and self._nbytes + nbytes > limit:
            self._remove(next(iter(self._entries)))
        self._entries[key] = Entry(key[1], layers, nbytes, shortest(layers, len(tokens)))
        self._nbytes += nbytes
        identity = self._ids.get(model)
        if write and self.disk is not None and identity is not None:
            self.disk.save(identity, key[1], layers)
        return True

    def layers(self, model: Hashable, tokens: Sequence[int]) -> Cache | None:
        """The layers of ``model``'s entry of exactly ``tokens``, if it is kept."""
        entry = self._entries.get((model, tuple(tokens)))
        return entry.layers if entry is not None else None

    def forget(self, model: Hashable, tokens: Sequence[int]) -> None:
        """Drop ``model``'s entry of exactly ``tokens``, if it is kept."""
        if (model, tuple(tokens)) in self._entries:
            self._remove((model, tuple(tokens)))

    def _remove(self, key: tuple[Hashable, tuple[int, ...]]) -> int:
        entry = self._entries.pop(key)
        self._nbytes -= entry.nbytes
        if self.mirror is not None:
            self.mirror.forgot(*key)
        return entry.nbytes

    def evict(self, nbytes: int) -> int:
        """Drop least recently used entries until ``nbytes`` are freed (or none are left)."""
        freed = 0
        while self._entries and freed < nbytes:
            freed += self._remove(next(iter(self._entries)))
        return freed

    def drop_model(self, model: Hashable) -> None:
        """Forget every entry of ``model`` (its images' too) and the prompts it saw (it is
        being evicted)."""
        for key in [k for k in self._entries if k[0] == model or _of_model(k[0], model)]:
            self._remove(key)
        for seen in [k for k in self._seen if k[0] == model]:
            del self._seen[seen]


def image_key(model: Hashable, digest: str) -> tuple[Hashable, str]:
    """The prefix-cache key of ``model``'s prompts over the images of ``digest``: a prefix
    holding images is shared only by prompts with the same images (their placeholder
    tokens are the same for any image)."""
    return (model, f"images:{digest}")


def _of_model(key: Hashable, model: Hashable) -> bool:
    return (
        isinstance(key, tuple)
        and len(key) == 2
        and key[0] == model
        and isinstance(key[1], str)
        and key[1].startswith("images:")
    )


def starting_cache(
    store: PrefixCache,
    room: Callable[[], int],
    models: Sequence[tuple[Hashable, Runs]],
    prompt: Sequence[int],
    boundary: int,
    limit: int,
    between: Callable[[], None] | None = None,
) -> tuple[Cache | None, int, int, tuple[int, ...]]:
    """Where a job's prompt starts: (cache, tokens it holds, tokens reused from entries kept
    before this job, the tokens of the target's entry it starts from), or (None, 0, 0, ()).

    ``models`` are (cache key, model) pairs, the target first (then the draft of a
    speculative job); the cache holds their layers in that order, all at the same
    length. When no entry covers the prompt's shared part (its first ``boundary``
    tokens) for a model, that part is prefilled on its own (from the entry covering the
    most of it) and kept first (``room()``: bytes the model cache can spare). This job
    takes at most ``limit`` tokens of it, and always leaves at least one token to
    prefill. ``between``: called between two chunks of that prefill.
    """
    if not store.enabled:
        return None, 0, 0, ()
    limit = min(limit, len(prompt) - 1)
    boundary = min(boundary, len(prompt) - 1)  # kept whole; this job may use less of it
    store.stats.lookups += 1
    found: list[tuple[Cache, int, tuple[int, ...]]] = []
    earlier = len(prompt)  # the target's tokens that entries kept before this job hold
    for i, (key, model) in enumerate(models):
        store.from_disk(key, model, prompt, room())
        matched = store.match(key, prompt)
        # A new entry only for MIN_TOKENS more than a kept one gives (a prompt seen before
        # whole, e.g. a job run again, would otherwise keep itself for a few tokens more).
        if boundary >= MIN_TOKENS and (matched is None or boundary - matched[1] >= MIN_TOKENS):
            base, held, since = None, 0, None  # extend the entry covering part of it, if any
            if matched is not None:
                base, held = restore(matched[0].layers, matched[1]), matched[1]
                since = matched[0].tokens
            base = base if base is not None else model.new_cache()
            tokens = tuple(prompt[:boundary])
            told = store.mirror.prefilling(key, tokens, since, held) if store.mirror else None
            with told or contextlib.nullcontext():
                filled = prefill(model.model, prompt, base, held, boundary, between)
                layers = snapshot(filled, boundary)
            if layers is None:
                return None, 0, 0, ()
            if not store.put(key, tokens, layers, room()) and store.mirror is not None:
                store.mirror.forgot(key, tokens)  # (a group starts only from what it keeps)
                return None, 0, 0, ()
            found.append((layers, boundary, tokens))
            earlier = held if i == 0 else earlier
        elif matched is not None:
            found.append((matched[0].layers, matched[1], matched[0].tokens))
        else:
            return None, 0, 0, ()
    n = min(min(k for _, k, _ in found), limit)
    if n < MIN_TOKENS or any(n < shortest(layers, k) for layers, k, _ in found):
        return None, 0, 0, ()
    reused = min(earlier, n)
    if reused:
        store.stats.hits += 1
        store.stats.tokens_reused += reused
    cache = [layer for layers, _, _ in found for layer in restore(layers, n)]
    return cache, n, reused, found[0][2]
