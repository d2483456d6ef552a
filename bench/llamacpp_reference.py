"""llama.cpp's own tokens and logits for a GGUF file: the reference ``tests/test_real.py`` checks
an imported model against (``tests/data/gemma3_270m_llamacpp.json``).

llama.cpp is not a dependency of mlxq: run this with a Python that has ``llama-cpp-python``
and ``gguf`` (built from its sdist here: ``pip install llama-cpp-python``, about 20 minutes
on 2 cores):

    /path/to/python bench/llamacpp_reference.py FILE.gguf tests/data/gemma3_270m_llamacpp.json
    /path/to/python bench/llamacpp_reference.py FILE.gguf OUT.json --pre smollm llama-bpe ...

``--pre``: the same probes tokenized by llama.cpp with the file's vocabulary under each
named pre-tokenizer (a copy of the file's metadata, no tensors, loaded vocab-only), so
the importer's table of pre-tokenizers is checked against llama.cpp name by name.
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
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "Contractions: I'm sure you'll see they've GONE, it's DON'T and We'RE.",
    "CamelCase HTTPServer getXMLHttpRequest iPhone 12345678901 Ωmega naïveTé",
    'JSON {"a": [1, 2, {"b": null}], "c": "d"}',
]
TOP = 5


def vocab_only(path: Path, pre: str, out: Path) -> None:
    """A GGUF with ``path``'s metadata (``tokenizer.ggml.pre`` set to ``pre``), no tensors."""
    import gguf

    reader = gguf.GGUFReader(path)
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(out, arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name in ("general.architecture", "tokenizer.ggml.pre"):
            continue
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), kind, sub_type=sub)
    writer.add_tokenizer_pre(pre)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def pre_variants(path: Path, names: list[str]) -> dict[str, list[list[int]]]:
    """Each probe of TOKENIZE as llama.cpp splits it under each pre-tokenizer name."""
    import tempfile

    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            copy = Path(tmp) / f"{name}.gguf"
            vocab_only(path, name, copy)
            llm = Llama(str(copy), vocab_only=True, verbose=False)
            out[name] = [llm.tokenize(t.encode(), add_bos=False, special=True) for t in TOKENIZE]
    return out


def main() -> None:
    path, out = Path(sys.argv[1]), Path(sys.argv[2])
    pres = sys.argv[sys.argv.index("--pre") + 1 :] if "--pre" in sys.argv else []
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
    if pres:
        report["pre_tokenizers"] = pre_variants(path, pres)
    out.write_text(json.dumps(report, indent=1, ensure_ascii=False) + "\n")
    print(json.dumps([(p["text"][:30], round(p["perplexity"], 2)) for p in report["prompts"]]))


if __name__ == "__main__":
    main()
