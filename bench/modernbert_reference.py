"""sentence-transformers' own vectors for the tests' tiny ModernBERT: the reference
``tests/test_embeddings.py`` checks ``worker.engine.modernbert`` against
(``tests/data/tiny_modernbert_reference.json``).

The model is random, made by ``worker.dev.tinyembed.write_modernbert`` (the same bytes on
every machine: the file records their SHA-256, and the test makes them again and checks);
sentence-transformers loads it through Hugging Face's own ``ModernBertModel``. Run with a
Python that has sentence-transformers and torch (see ``bench/minilm_reference.py``):

    .venv/bin/python -c "from pathlib import Path; from worker.dev.tinyembed import \\
        write_modernbert as w; w(Path('/tmp/tiny-modernbert'))"
    /tmp/stref/bin/python bench/modernbert_reference.py /tmp/tiny-modernbert \\
        tests/data/tiny_modernbert_reference.json
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import numpy as np
import sentence_transformers
import torch
import transformers
from sentence_transformers import SentenceTransformer

#: Short texts (global and local layers alike) and long ones (the local layers see 4
#: positions either side: a different graph from the global layers past 9 tokens).
TEXTS = [
    "hello",
    "the queue worker",
    "the queue worker model token draft target redis job batch result metric apple silicon",
    "apple silicon " * 12,
    "a job batch of results, each with its metric and its draft; the target takes them all",
]
FILES = ("model.safetensors", "tokenizer.json", "config.json")


def main() -> None:
    model_dir, out = Path(sys.argv[1]), Path(sys.argv[2])
    model = SentenceTransformer(str(model_dir), device="cpu")
    vectors = model.encode(TEXTS, convert_to_numpy=True)
    ref = {
        "source": (
            f"sentence-transformers {sentence_transformers.__version__}, transformers "
            f"{transformers.__version__} (ModernBertModel), torch {torch.__version__} CPU: "
            "made by bench/modernbert_reference.py"
        ),
        "sha256": {f: hashlib.sha256((model_dir / f).read_bytes()).hexdigest() for f in FILES},
        "texts": TEXTS,
        "tokens": [len(model.tokenizer(t)["input_ids"]) for t in TEXTS],
        "vectors": [[float(f"{x:.7g}") for x in v] for v in np.asarray(vectors)],
    }
    out.write_text(json.dumps(ref, indent=0) + "\n")
    print(f"{out}: {len(TEXTS)} vectors; tokens {ref['tokens']}")


if __name__ == "__main__":
    main()
