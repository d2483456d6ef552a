"""What a model and a machine are, for the fleet's shared figures (``worker.runner.figures``).

- :func:`weights_identity`: a model (or adapter) directory by its weights, not its
  name: two names of the same weights are one model, and new weights under an old
  name are a new one. A hub file (a link into the HF cache's ``blobs/``) is named by
  its content's hash already; any other weight file is read in a few sampled
  places (its size, first, middle and last 64 KiB), so a 40 GB model costs
  milliseconds, not a full read.
- :func:`machine_kind`: the chip and memory (``sysctl`` on macOS, ``/proc`` on
  Linux) and MLX's device type; ``--machine-kind`` overrides it.
"""

from __future__ import annotations

import hashlib
import os
import platform
import re
import subprocess
from pathlib import Path

#: Bytes read at each sampled place of a weight file that is not a hub blob.
SAMPLE = 65_536
#: Files that hold weights (configs and tokenizers are not what the figures measure).
WEIGHT_GLOBS = ("*.safetensors", "*.gguf", "*.npz")
_BLOB = re.compile(r"[0-9a-f]{64}")


def weights_identity(path: Path) -> str:
    """A 20-hex-digit identity of the weight files in directory ``path``."""
    h = hashlib.sha256()
    files = sorted({f for g in WEIGHT_GLOBS for f in path.glob(g)})
    if not files:
        raise FileNotFoundError(f"no weight files in {path}")
    for f in files:
        h.update(f.name.encode() + b"\0")
        real = f.resolve()
        if real.parent.name == "blobs" and _BLOB.fullmatch(real.name):
            h.update(real.name.encode())  # the hub named it by its content
            continue
        size = real.stat().st_size
        h.update(str(size).encode())
        with open(real, "rb") as fh:
            for at in sorted({0, max(size // 2 - SAMPLE // 2, 0), max(size - SAMPLE, 0)}):
                fh.seek(at)
                h.update(fh.read(SAMPLE))
    return h.hexdigest()[:20]


def machine_kind() -> str:
    """This machine's kind, as workers that share figures compare it (``MLXQ_MACHINE_KIND``
    or ``--machine-kind`` overrides): chip, memory and MLX's device type."""
    import mlx.core as mx

    chip, memory = _chip_and_memory()
    device = "gpu" if mx.default_device() == mx.gpu else "cpu"
    return f"{chip}, {round(memory / 2**30)} GB, {device}"


def _chip_and_memory() -> tuple[str, int]:
    if platform.system() == "Darwin":
        chip = _sysctl("machdep.cpu.brand_string") or platform.machine()
        return chip, int(_sysctl("hw.memsize") or 0)
    chip = platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                chip = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        memory = 0
    return chip, memory


def _sysctl(name: str) -> str | None:
    try:
        out = subprocess.run(["sysctl", "-n", name], capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None
