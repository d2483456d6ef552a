"""sentence-transformers' own vectors for all-MiniLM-L6-v2: the reference
``tests/test_embeddings.py`` checks mlxq's encoder against (``tests/data/minilm_reference.json``).

sentence-transformers is not a dependency of mlxq (it needs torch): run this with a Python
that has it, on the model directory mlxq unpacks from the package index
(``worker.dev.tinyembed.minilm``), e.g. in a scratch venv:

    python3 -m venv /tmp/stref
    /tmp/stref/bin/pip install torch==2.13.0 sentence-transformers   # CPU torch first
    /tmp/stref/bin/python bench/minilm_reference.py .mlxq/models/all-MiniLM-L6-v2 \\
        tests/data/minilm_reference.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import sentence_transformers
import torch
from sentence_transformers import SentenceTransformer

#: The texts: sentence-transformers' documentation examples first (the first values of
#: two and the cosine score of the third and fourth are printed there too), then shapes
#: an encoder gets wrong in different ways: one word, case and accents (the uncased
#: tokenizer strips them), digits and punctuation, CJK (split per character), an unknown
#: symbol, code, and a paragraph of ~150 tokens.
TEXTS = [
    "This is an example sentence",
    "Each sentence is converted",
    "A man is eating food.",
    "A man is eating a piece of bread.",
    "The weather is lovely today.",
    "It's so sunny outside!",
    "Hello",
    "Café NAÏVE Résumé: ÜBER élan",
    "Order #4521 shipped on 2024-03-07 for $1,299.99 (qty: 3) -- ETA 5-7 days!",
    "東京は日本の首都です。",
    "emoji 🚀 and symbols ∑ ∫ ≠",
    "def mean(xs):\n    return sum(xs) / len(xs)",
    " ".join(
        [
            "The history of the city begins in the Roman period, when a small settlement",
            "grew up on the north bank of the river. Over the following centuries it became",
            "a market town, then a cathedral city, and by the eighteenth century one of the",
            "busiest ports in the country, trading in wool, cloth, timber and later coal.",
            "Its old quarter keeps the street plan of the medieval town: narrow lanes run",
            "down to the quays from the market square, where the guildhall, rebuilt after",
            "a fire in 1680, still stands beside the church of Saint Mary. The railway came",
            "in 1841 and the docks were enlarged twice before the First World War; most of",
            "them closed in the 1970s and are now housing, offices and a maritime museum.",
        ]
    ),
]


def main() -> None:
    model_dir, out = Path(sys.argv[1]), Path(sys.argv[2])
    model = SentenceTransformer(str(model_dir), device="cpu")
    vectors = model.encode(TEXTS, convert_to_numpy=True, normalize_embeddings=False)
    tokens = [len(model.tokenizer(t)["input_ids"]) for t in TEXTS]
    assert max(tokens) <= model.max_seq_length, tokens  # (no text truncated)
    ref = {
        "source": (
            f"sentence-transformers {sentence_transformers.__version__} (torch "
            f"{torch.__version__}, CPU): SentenceTransformer(<all-MiniLM-L6-v2 from the "
            "package index>).encode(texts), made by bench/minilm_reference.py"
        ),
        "texts": TEXTS,
        "tokens": tokens,
        "vectors": [[float(f"{x:.7g}") for x in v] for v in np.asarray(vectors)],
    }
    out.write_text(json.dumps(ref, indent=0, ensure_ascii=False) + "\n")
    print(f"{out}: {len(TEXTS)} vectors of {vectors.shape[1]}; tokens {tokens}")


if __name__ == "__main__":
    main()
