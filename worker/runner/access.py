"""Which models a job may make this worker load (``--model-dir``, ``--allow-model``).

Anyone who can write a job names the models a worker loads, so a name is a request
to read the worker's disk and to download from the hub. The rules:

- **Local models** come from the worker's model directories (``--model-dir``,
  ``.mlxq/models`` by default) and from its own ``--model`` names. A job names one
  by its path, or by its name inside a model directory (``"model": "gemma-3-270m"``).
  Any other local path is served only if an ``--allow-model`` glob matches its
  absolute, symlink-resolved path (so ``..`` and links cannot walk out of an
  allowed directory).
- **Hub repositories** are fetched as before, unless ``--allow-model`` globs are
  given: then only repositories that one of them matches.
- A refusal says the same whatever is on the worker's disk: it never tells the
  submitter whether a path exists, is a file, or holds a model.

Without a :class:`ModelAccess` (the library default) any local path is served, as
mlx-lm does; the ``worker`` command always builds one.
"""

from __future__ import annotations

import fnmatch
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from schemas import ModelNotAllowedError

#: Default model directory (``worker import-gguf`` and the demo write here).
DEFAULT_MODEL_DIR = Path(".mlxq") / "models"
#: A hub repository id as huggingface-hub accepts it: ``name`` or ``owner/name``.
HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,95}(/[A-Za-z0-9][A-Za-z0-9._-]{0,95})?$")
#: Longest model name looked at (longer ones are refused unread).
MAX_NAME = 1024


def _real(path: str | Path) -> Path:
    return Path(os.path.realpath(Path(path).expanduser()))


def _inside(path: Path, root: Path) -> bool:
    return path == root or root in path.parents


def _explicit_path(name: str) -> bool:
    """Written as a path (absolute, ``./``, ``../``, ``~``), not as a hub id."""
    return name.startswith(("/", "./", "../", "~", ".\\")) or "\\" in name


@dataclass(frozen=True)
class ModelAccess:
    """The worker's model directories, ``--allow-model`` globs and ``--model`` names."""

    dirs: tuple[Path, ...] = (DEFAULT_MODEL_DIR,)
    allow: tuple[str, ...] = ()
    named: frozenset[Path] = field(default_factory=frozenset)

    @classmethod
    def build(cls, dirs: Iterable[str | Path], allow: Iterable[str] = ()) -> ModelAccess:
        return cls(tuple(_real(d) for d in dirs), tuple(os.path.expanduser(p) for p in allow))

    def with_named(self, name: str) -> ModelAccess:
        """This access plus ``name`` (a ``--model`` the operator gave), after checking it
        against the ``--allow-model`` globs when there are any."""
        where = self.where(name, "model", operator=True)
        if isinstance(where, Path):
            return ModelAccess(self.dirs, self.allow, self.named | {where})
        return self

    def _globbed(self, text: str) -> bool:
        return any(fnmatch.fnmatchcase(text, p) for p in self.allow)

    def _refuse(self, name: str, what: str) -> ModelNotAllowedError:
        hub = (
            f"hub repositories matching {', '.join(self.allow)}"
            if self.allow
            else "hub repositories"
        )
        return ModelNotAllowedError(
            f"{what} {name!r} is not allowed on this worker: it serves {hub}, and local models "
            "only from its model directories (worker --model-dir) or named by --model / "
            "--allow-model"
        )

    def where(self, name: str, what: str = "model", operator: bool = False) -> Path | str:
        """Where ``name`` is served from: a local directory (not checked to exist when it
        is in an allowed place) or a hub repository id. Raises
        :class:`ModelNotAllowedError` for anything else. ``operator``: the name comes
        from the worker's own ``--model`` (any local path, unless globs say otherwise)."""
        if not name or len(name) > MAX_NAME or any(ord(c) < 32 for c in name):
            raise ModelNotAllowedError(f"{what} name is empty, too long or has control characters")
        explicit = _explicit_path(name)
        if not explicit and ".." not in Path(name).parts:
            for root in self.dirs:  # a name inside a model directory
                candidate = _real(root / name)
                if _inside(candidate, root) and candidate.is_dir():
                    return candidate
        local = _real(name)
        allowed_local = (
            any(_inside(local, root) for root in self.dirs)
            or local in self.named
            or self._globbed(str(local))
        )
        if allowed_local and (explicit or local.exists()):
            return local
        if operator and not self.allow and (explicit or local.exists()):
            return local
        if not explicit and HUB_ID.match(name) and (not self.allow or self._globbed(name)):
            return name
        raise self._refuse(name, what)

    def locate(self, name: str) -> Path:
        """The directory to load ``name`` from (a hub repository is fetched): what the
        model cache calls instead of :func:`worker.engine.models.resolve_path`."""
        from worker.engine.models import hub_snapshot, resolve_path

        where = self.where(name)
        return resolve_path(str(where)) if isinstance(where, Path) else hub_snapshot(where)

    def local(self, name: str) -> Path | None:
        """The directory :meth:`locate` would load ``name`` from, if it is on this machine
        already (None: a hub repository not fetched yet). Never downloads."""
        from worker.engine.models import cached_snapshot

        where = self.where(name)
        if isinstance(where, Path):
            return where if where.is_dir() else None
        return cached_snapshot(where)

    def describe(self) -> list[str]:
        """What this worker serves, for ``producer fleet``."""
        out = [f"dir {d}" for d in self.dirs] + [f"--model {p}" for p in sorted(self.named)]
        out += [f"--allow-model {p}" for p in self.allow] or ["hub: any repository"]
        return out
