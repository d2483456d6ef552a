"""Kept prefixes on disk: a new or restarted worker on the same machine starts from them.

``worker --prefix-cache-dir DIR``: every prefix the prefix cache keeps
(``worker.engine.prefix``) is also written to DIR, one ``.safetensors`` file per
entry in mlx-lm's prompt-cache format (``save_prompt_cache``: each layer's state and
class, so every cache type mlx-lm makes), its metadata naming the model by its
weights' identity (``worker.engine.identity``: not its name) and the entry's tokens.
A job whose prompt begins with an entry on disk that is longer than what memory holds
loads it into the prefix cache first.

- **Off the hot path**: a writer thread saves entries (a bounded queue; an entry that
  finds it full is not written); the job that made the entry goes on at once. The
  file's arrays are made on the job's thread; the writer only writes their bytes (no
  MLX computation runs on two threads at once).
- **Atomic**: written to a temporary file in DIR, then renamed; two workers on one
  directory never see half a file, and the same entry written twice is one file.
- **LRU on disk**: a file's time is touched when it is loaded; past
  ``--prefix-cache-disk-gb`` the least recently used files go (whoever wrote them).
- **Never fails a job**: a corrupt, truncated, foreign (not mlxq's, another format
  version) or mismatched file (its layers are not the model's) is skipped with one
  warning and deleted; a write that fails (disk full, read-only) turns the disk off
  for this process with one warning: the cache goes on in memory only.

Pure MLX and the file system; no Redis, no jobs.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import json
import logging
import os
import queue
import secrets
import struct
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.models.cache import load_prompt_cache

from worker.engine.rewind import leaves

log = logging.getLogger(__name__)

#: What mlxq writes in each file's metadata (``format``); other values are foreign.
FORMAT = "mlxq-prefix-1"
SUFFIX = ".safetensors"
#: Files being written start so (renamed once whole; left by a dead writer: deleted).
TMP = ".tmp-"
#: Entries waiting to be written, at most (more are dropped: the disk is a second copy).
QUEUED = 16
#: A temporary file older than this (seconds) was left by a writer that died.
STALE_TMP_S = 600.0
#: Default size of the directory (``--prefix-cache-disk-gb``).
DEFAULT_DISK_BYTES = 10_000_000_000

Cache = list[Any]


@dataclass(frozen=True)
class DiskEntry:
    """A prefix on disk: its file, its model's identity and its tokens."""

    path: Path
    identity: str
    tokens: tuple[int, ...]


class BadFile(Exception):
    """A file that is not a readable mlxq prefix: it is deleted."""


def read_header(path: Path) -> tuple[str, tuple[int, ...]]:
    """(identity, tokens) from a prefix file's safetensors header (its arrays unread).
    Raises :class:`BadFile` naming what is wrong."""
    try:
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) != 8:
                raise BadFile("shorter than a safetensors header")
            (size,) = struct.unpack("<Q", raw)
            if size > 64 << 20:
                raise BadFile(f"a {size}-byte header")
            header = json.loads(f.read(size))
            end = f.seek(0, os.SEEK_END)
    except (OSError, ValueError, UnicodeDecodeError) as e:
        raise BadFile(f"unreadable header ({e})") from None
    meta = header.get("__metadata__") if isinstance(header, dict) else None
    if not isinstance(meta, dict) or meta.get("0.format") != FORMAT:
        raise BadFile("not an mlxq prefix file (format)")
    stops = [v.get("data_offsets", [0, 0])[1] for k, v in header.items() if k != "__metadata__"]
    if 8 + size + max(stops, default=0) > end:
        raise BadFile("truncated")
    try:
        tokens = tuple(int(t) for t in json.loads(meta["0.tokens"]))
        identity = str(meta["0.identity"])
    except (KeyError, ValueError, TypeError) as e:
        raise BadFile(f"bad metadata ({e})") from None
    if not tokens or not identity:
        raise BadFile("no tokens or no identity")
    return identity, tokens


class PrefixDisk:
    """Prefix entries in a directory, shared by the workers of one machine."""

    def __init__(self, root: Path, budget_bytes: int = DEFAULT_DISK_BYTES) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.budget_bytes = max(0, int(budget_bytes))
        self.enabled = self.budget_bytes > 0
        self._index: dict[str, dict[tuple[int, ...], DiskEntry]] = {}
        self._seen_mtime = -1.0
        self._lock = threading.Lock()
        self._queue: queue.Queue[tuple[Any, ...] | None] = queue.Queue(QUEUED)
        self._writer: threading.Thread | None = None
        self._scan()

    # -- reading ------------------------------------------------------------
    def _scan(self) -> None:
        """Index the directory's files (what other workers wrote since the last scan too)."""
        try:
            mtime = self.root.stat().st_mtime
        except OSError:
            return
        if mtime == self._seen_mtime:
            return
        self._seen_mtime = mtime
        index: dict[str, dict[tuple[int, ...], DiskEntry]] = {}
        now = time.time()
        for path in self.root.iterdir():
            if path.name.startswith(TMP):
                with contextlib.suppress(OSError):
                    if now - path.stat().st_mtime > STALE_TMP_S:
                        path.unlink()
                continue
            if not path.name.endswith(SUFFIX):
                continue
            try:
                identity, tokens = read_header(path)
            except BadFile as e:
                self._drop(path, str(e))
                continue
            index.setdefault(identity, {})[tokens] = DiskEntry(path, identity, tokens)
        with self._lock:
            self._index = index

    def longest(self, identity: str, prompt: Sequence[int]) -> DiskEntry | None:
        """The longest entry of the model ``identity`` that ``prompt`` begins with (and
        goes past: a prompt must keep a token to prefill)."""
        self._scan()
        with self._lock:
            entries = list(self._index.get(identity, {}).values())
        head = tuple(prompt)
        best = None
        for e in entries:
            n = len(e.tokens)
            if n < len(head) and head[:n] == e.tokens and (best is None or n > len(best.tokens)):
                best = e
        return best

    def load(self, entry: DiskEntry, fresh: Cache) -> Cache | None:
        """``entry``'s layers for a model (their classes checked against ``fresh``, an
        empty cache of the model as the engines make it), or None: a bad file is deleted
        with a warning, a gone one forgotten."""
        try:
            layers, meta = load_prompt_cache(str(entry.path), return_metadata=True)
        except FileNotFoundError:
            self._forget(entry)
            return None
        except Exception as e:  # a truncated or corrupt array section
            self._drop(entry.path, f"unreadable ({type(e).__name__}: {e})", entry)
            return None
        want = [type(c).__name__ for c in leaves(fresh)]
        got = [type(c).__name__ for c in leaves(layers)]
        if got != want or meta.get("identity") != entry.identity:
            self._drop(entry.path, f"its layers ({len(got)}) are not the model's", entry)
            return None
        with contextlib.suppress(OSError):
            os.utime(entry.path)  # recently used: the last to go
        return layers

    # -- writing ------------------------------------------------------------
    def save(self, identity: str, tokens: Sequence[int], layers: Cache) -> None:
        """Queue ``layers`` (the state of exactly ``tokens``, evaluated) to be written."""
        key = tuple(int(t) for t in tokens)
        if not self.enabled:
            return
        with self._lock:
            if key in self._index.get(identity, {}):
                return
        if self._writer is None:
            self._writer = threading.Thread(target=self._write_loop, name="prefix-disk")
            self._writer.daemon = True
            self._writer.start()
            atexit.register(self.flush)
        if self._queue.full():
            return  # (the disk is a second copy: this one is not written)
        meta = {"format": FORMAT, "identity": identity, "tokens": json.dumps(list(key))}
        with contextlib.suppress(queue.Full):
            self._queue.put_nowait((identity, key, *_file_content(layers, meta)))

    def flush(self, timeout_s: float = 30.0) -> None:
        """Wait (up to ``timeout_s``) until the queued entries are written."""
        if self._writer is None:
            return
        deadline = time.monotonic() + timeout_s
        while self._queue.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.01)

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is not None and self.enabled:
                    self._write(*item)
            except Exception:  # never let the writer die: the next entry may go
                log.exception("prefix cache on disk: write failed")
            finally:
                self._queue.task_done()

    def _write(
        self,
        identity: str,
        tokens: tuple[int, ...],
        arrays: dict[str, mx.array],
        metadata: dict[str, str],
    ) -> None:
        name = f"{identity}-{_digest(tokens)}{SUFFIX}"
        final = self.root / name
        # (mlx names what it saves *.safetensors: the temporary is one too)
        tmp = self.root / f"{TMP}{os.getpid()}-{secrets.token_hex(4)}-{name}"
        try:
            mx.save_safetensors(str(tmp), arrays, metadata)  # evaluated arrays: bytes only
            os.replace(tmp, final)
        except OSError as e:
            with contextlib.suppress(OSError):
                tmp.unlink()
            self.enabled = False
            log.warning(
                "prefix cache on disk off for this worker: writing %s failed (%s); "
                "kept prefixes stay in memory",
                self.root,
                e,
            )
            return
        with self._lock:
            self._index.setdefault(identity, {})[tokens] = DiskEntry(final, identity, tokens)
        self._evict()

    def _evict(self) -> None:
        """Delete the least recently used files past the budget (any worker's)."""
        files = []
        for path in self.root.glob(f"*{SUFFIX}"):
            if path.name.startswith(TMP):
                continue
            with contextlib.suppress(OSError):
                st = path.stat()
                files.append((st.st_mtime, st.st_size, path))
        total = sum(size for _, size, _ in files)
        for _, size, path in sorted(files):
            if total <= self.budget_bytes:
                break
            with contextlib.suppress(OSError):
                path.unlink()
            total -= size

    # -- bad files ----------------------------------------------------------
    def _forget(self, entry: DiskEntry) -> None:
        with self._lock:
            self._index.get(entry.identity, {}).pop(entry.tokens, None)

    def _drop(self, path: Path, why: str, entry: DiskEntry | None = None) -> None:
        log.warning("prefix cache on disk: %s skipped and deleted: %s", path.name, why)
        with contextlib.suppress(OSError):
            path.unlink()
        if entry is not None:
            self._forget(entry)


def _file_content(layers: Cache, meta: dict[str, str]) -> tuple[dict[str, Any], dict[str, str]]:
    """What mlx-lm's ``save_prompt_cache`` writes for ``layers`` (its layout, so its
    ``load_prompt_cache`` reads the file), made and evaluated on the caller's thread: the
    writer thread then runs no MLX computation beside the jobs', only writes bytes."""
    scalars: list[Any] = [""]  # (as mlx-lm: never empty, or tree_flatten drops it)

    def as_array(item: tuple[str, Any]) -> tuple[str, mx.array]:
        i, data = item
        if isinstance(data, mx.array):
            return item
        if isinstance(data, (int, float, bool)):
            scalars.append((i, "scalar"))
            return i, mx.array(data)
        if isinstance(data, str):
            scalars.append((i, "string"))
            return i, mx.array([ord(c) for c in data])
        if data is None:
            scalars.append((i, "none"))
            return i, mx.array([])
        raise ValueError(f"a cache state holds {type(data).__name__}: not written")

    arrays = dict(map(as_array, tree_flatten([c.state for c in layers])))
    classes = [type(c).__name__ for c in layers]
    metadata = dict(tree_flatten([meta, classes, scalars]))
    mx.eval(list(arrays.values()))
    return arrays, metadata


def _digest(tokens: tuple[int, ...]) -> str:
    return hashlib.sha256(json.dumps(tokens).encode()).hexdigest()[:24]
