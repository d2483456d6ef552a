"""llama.cpp's own tokens and logits for a GGUF file: the reference ``tests/test_real.py`` checks
an imported model against (``tests/data/gemma3_270m_llamacpp.json``).

llama.cpp is not a dependency of mlxq: run this with a Python that has ``llama-cpp-python``
(built from its sdist here: ``pip install llama-cpp-python``, about 20 minutes on 2 cores):

    /path/to/python bench/llamacpp_reference.py FILE.gguf tests/data/gemma3_270m_llamacpp.json
"""

from __future__ import annotations

import hashlib
import json
import math
import sys
from pathlib import Path

import numpy as np
from llama_cpp import Llama, __version__

PROMPTS = [
    "The history of the city begins in the Roman period, when a small settlement grew up on"
    " the north bank of the river.",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "Paris is the capital of",
]
TOKENIZE = [
    "  two leading spaces and   three inside\n\nnew paragraph\n\n\n\tTabbed",
    "def f(x):\n    return x ** 2  # square\n",
    "Numbers: 1234567 3.14159 -42 1e10, dates 2026-12-02.",
    "Unicode: café naïve Straße 東京 Москва 🚀🎉 ∑∫√",
    "<start_of_turn>user\nHi there<end_of_turn>\n<start_of_turn>model\n",
    'JSON {"a": [1, 2, {"b": null}], "c": "d"}',
]
TOP = 5


def main() -> None:
    path, out = Path(sys.argv[1]), Path(sys.argv[2])
    llm = Llama(str(path), n_ctx=512, logits_all=True, verbose=False, n_threads=2, seed=0)
    report: dict = {
        "file_sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
        "llama_cpp_python": __version__,
        "top": TOP,
        "prompts": [],
        "tokenize": [],
    }
    for text in PROMPTS:
        ids = llm.tokenize(text.encode(), add_bos=True, special=False)
        llm.reset()
        llm.eval(ids)
        scores = np.array(llm.scores[: len(ids)], dtype=np.float64)
        top = scores.max(-1, keepdims=True)
        logp = scores - top - np.log(np.exp(scores - top).sum(-1, keepdims=True))
        nll = -float(np.mean([logp[i, ids[i + 1]] for i in range(len(ids) - 1)]))
        top = np.argsort(-scores, axis=-1)[:, :TOP]
        report["prompts"].append(
            {
                "text": text,
                "ids": ids,
                "perplexity": math.exp(nll),
                "top_ids": top.tolist(),
                "top_logits": np.take_along_axis(scores, top, -1).round(4).tolist(),
            }
        )
    for text in TOKENIZE:
        ids = llm.tokenize(text.encode(), add_bos=False, special=True)
        report["tokenize"].append({"text": text, "ids": ids})
    out.write_text(json.dumps(report, indent=1, ensure_ascii=False) + "\n")
    print(json.dumps([(p["text"][:30], round(p["perplexity"], 2)) for p in report["prompts"]]))


if __name__ == "__main__":
    main()
