"""Constrained-decoding libraries side by side: llguidance, xgrammar, outlines-core.

On a 32,000-entry byte-level BPE (trained locally on Python's standard library:
realistic merges such as ``":``, ``Ġ"`` and ``",``), for a typical 10-field
extraction schema, each library's

- tokenizer set-up time (once per tokenizer, cached by a worker),
- compile time of the schema (plus its first mask, where a library compiles lazily),
- mask time per token while walking a valid document token by token (mean, p99),
  for one sequence and for a batch of 8 sequences in lockstep.

Each library runs in its own process (``--python`` per library: xgrammar needs
torch, which mlxq does not install). Libraries that are not importable are
reported as such, not skipped silently.

    .venv/bin/python -m bench.grammar [--xgrammar-python /tmp/xgvenv/bin/python]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 80},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string", "pattern": "^[a-z0-9.]+@[a-z0-9]+\\.[a-z]{2,6}$"},
        "country": {"enum": ["US", "GB", "DE", "FR", "JP", "BR"]},
        "is_customer": {"type": "boolean"},
        "score": {"type": "number"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
        "address": {
            "type": "object",
            "properties": {
                "street": {"type": "string"},
                "city": {"type": "string"},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["street", "city", "zip"],
            "additionalProperties": False,
        },
        "phone": {"type": "string", "pattern": "^\\+?[0-9 ]{7,15}$"},
        "joined": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
    },
    "required": [
        "name",
        "age",
        "email",
        "country",
        "is_customer",
        "score",
        "tags",
        "address",
        "phone",
        "joined",
    ],
    "additionalProperties": False,
}

DOCUMENT = {
    "name": "Alice Smith",
    "age": 31,
    "email": "alice.smith@example.com",
    "country": "GB",
    "is_customer": True,
    "score": 87.5,
    "tags": ["priority", "newsletter", "beta"],
    "address": {"street": "12 Market Street", "city": "Leeds", "zip": "12345"},
    "phone": "+44 113 496 0000",
    "joined": "2024-03-17",
}

BATCH = 8


def tokenizer_path() -> Path:
    """The 32k byte-level BPE, trained once into the bench cache (mlx-free import)."""
    from bench.fixtures import cache_dir
    from worker.dev.tinymodels import write_bytelevel_tokenizer

    path = cache_dir() / "bpe32k-tokenizer"
    if not (path / "tokenizer.json").exists():
        write_bytelevel_tokenizer(path)
    return path


def _stats(samples: list[float]) -> dict[str, float]:
    samples = sorted(samples)
    return {
        "mean_us": statistics.fmean(samples) * 1e6,
        "p50_us": samples[len(samples) // 2] * 1e6,
        "p99_us": samples[min(len(samples) - 1, int(len(samples) * 0.99))] * 1e6,
    }


class _Lib:
    """One library's set-up, compile, mask and advance, behind one interface."""

    name = ""

    def setup(self, hf: Any) -> None: ...
    def compile(self, schema: dict[str, Any]) -> Any: ...
    def matcher(self, compiled: Any) -> Any: ...
    def mask(self, matchers: list[Any]) -> None: ...
    def advance(self, matcher: Any, token: int) -> None: ...


class _LLGuidance(_Lib):
    name = "llguidance"

    def setup(self, hf: Any) -> None:
        import llguidance
        import llguidance.hf
        import llguidance.numpy as lnp

        self.ll, self.lnp = llguidance, lnp
        self.tok = llguidance.hf.from_tokenizer(hf)
        self.executor = llguidance.LLExecutor()
        self.bits = lnp.allocate_token_bitmask(BATCH, self.tok.vocab_size)

    def compile(self, schema: dict[str, Any]) -> Any:
        grammar = self.ll.LLMatcher.grammar_from_json_schema(schema)
        m = self.ll.LLMatcher(self.tok, grammar)
        self.lnp.fill_next_token_bitmask(m, self.bits, 0)  # it compiles lazily: count it
        if m.is_error():
            raise RuntimeError(m.get_error())
        return grammar

    def matcher(self, compiled: Any) -> Any:
        return self.ll.LLMatcher(self.tok, compiled)

    def mask(self, matchers: list[Any]) -> None:
        if len(matchers) == 1:
            self.lnp.fill_next_token_bitmask(matchers[0], self.bits, 0)
        else:
            pairs = [(m, i) for i, m in enumerate(matchers)]
            self.lnp.fill_next_token_bitmask_par(self.executor, pairs, self.bits)

    def advance(self, matcher: Any, token: int) -> None:
        if not matcher.consume_token(token):
            raise RuntimeError(f"llguidance refused token {token}: {matcher.get_error()}")


class _XGrammar(_Lib):
    name = "xgrammar"

    def setup(self, hf: Any) -> None:
        import xgrammar

        self.xg = xgrammar
        self.info = xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=len(hf))
        self.compiler = xgrammar.GrammarCompiler(self.info, cache_enabled=False)
        self.bits = xgrammar.allocate_token_bitmask(BATCH, len(hf))

    def compile(self, schema: dict[str, Any]) -> Any:
        compiled = self.compiler.compile_json_schema(json.dumps(schema))
        self.xg.GrammarMatcher(compiled).fill_next_token_bitmask(self.bits, 0)
        return compiled

    def matcher(self, compiled: Any) -> Any:
        return self.xg.GrammarMatcher(compiled)

    def mask(self, matchers: list[Any]) -> None:
        for i, m in enumerate(matchers):
            m.fill_next_token_bitmask(self.bits, i)

    def advance(self, matcher: Any, token: int) -> None:
        if not matcher.accept_token(token):
            raise RuntimeError(f"xgrammar refused token {token}")


class _OutlinesCore(_Lib):
    name = "outlines-core"

    def setup(self, hf: Any) -> None:
        import numpy as np
        import outlines_core
        from tokenizers import decoders

        self.oc = outlines_core
        byte_decoder = decoders.ByteLevel()
        eos = hf.eos_token_id
        tokens: dict[bytes, list[int]] = {}
        for token, i in hf.get_vocab().items():
            if i == eos or token in hf.all_special_tokens:
                continue
            raw = byte_decoder.decode([token]).encode("utf-8", "surrogateescape")
            tokens.setdefault(raw, []).append(i)
        self.vocabulary = outlines_core.Vocabulary(eos, tokens)
        self.bits = np.zeros((BATCH, (len(hf) + 31) // 32), dtype=np.int32)

    def compile(self, schema: dict[str, Any]) -> Any:
        regex = self.oc.json_schema.build_regex_from_schema(json.dumps(schema))
        index = self.oc.Index(regex, self.vocabulary)
        self.matcher(index)
        return index

    def matcher(self, compiled: Any) -> Any:
        return self.oc.Guide(compiled)

    def mask(self, matchers: list[Any]) -> None:
        row = self.bits.shape[1]
        for i, m in enumerate(matchers):
            m.write_mask_into(self.bits[i].ctypes.data, row, 4)

    def advance(self, matcher: Any, token: int) -> None:
        matcher.advance(token)


LIBS = {lib.name: lib for lib in (_LLGuidance, _XGrammar, _OutlinesCore)}


def measure(name: str, tok_dir: Path, repeats: int) -> dict[str, Any]:
    """Everything for one library, in this process."""
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(tok_dir))
    lib = LIBS[name]()
    t = time.perf_counter()
    lib.setup(hf)
    setup_s = time.perf_counter() - t
    compiles = []
    for _ in range(repeats):
        t = time.perf_counter()
        compiled = lib.compile(SCHEMA)
        compiles.append(time.perf_counter() - t)
    doc = hf.encode(json.dumps(DOCUMENT), add_special_tokens=False)
    out: dict[str, Any] = {
        "library": name,
        "version": _version(name),
        "vocab": len(hf),
        "tokenizer_setup_s": setup_s,
        "compile_s": statistics.median(compiles),
        "doc_tokens": len(doc),
    }
    for batch in (1, BATCH):
        steps = []
        for _ in range(repeats):
            matchers = [lib.matcher(compiled) for _ in range(batch)]
            for token in doc:
                t = time.perf_counter()
                lib.mask(matchers)
                for m in matchers:
                    lib.advance(m, token)
                steps.append(time.perf_counter() - t)
        out[f"step_batch{batch}"] = _stats(steps)
    return out


def _version(name: str) -> str:
    from importlib.metadata import version

    return version(name.replace("-", "_") if name == "outlines-core" else name)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--xgrammar-python", default=sys.executable, help="a Python with xgrammar")
    ap.add_argument("--only", help=argparse.SUPPRESS)
    ap.add_argument("--tokenizer", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.only:  # a child: one library, JSON out
        print(json.dumps(measure(args.only, Path(args.tokenizer), args.repeats)))
        return
    tok = tokenizer_path()
    print(f"tokenizer: {tok} (32,000 entries, byte-level BPE); schema: 10 fields")
    rows = []
    for name in LIBS:
        python = args.xgrammar_python if name == "xgrammar" else sys.executable
        cmd = [python, "-m", "bench.grammar", "--only", name, "--tokenizer", str(tok)]
        proc = subprocess.run(
            [*cmd, "--repeats", str(args.repeats)],
            capture_output=True,
            text=True,
            cwd=Path(__file__).resolve().parent.parent,
        )
        if proc.returncode != 0:
            err = proc.stderr.strip().splitlines()
            print(f"{name}: not measured ({err[-1] if err else 'failed'})")
            continue
        rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    head = (
        f"{'library':<14} {'version':<8} {'tok set-up':>10} {'compile':>9} "
        f"{'mask+advance/token: 1 seq mean':>31} {'p99':>8} {'8 seqs mean':>12} {'p99':>8}"
    )
    print(head)
    for r in rows:
        one, eight = r["step_batch1"], r[f"step_batch{BATCH}"]
        print(
            f"{r['library']:<14} {r['version']:<8} {r['tokenizer_setup_s'] * 1e3:>8.0f}ms "
            f"{r['compile_s'] * 1e3:>7.1f}ms {one['mean_us']:>29.0f}us {one['p99_us']:>6.0f}us "
            f"{eight['mean_us']:>10.0f}us {eight['p99_us']:>6.0f}us"
        )
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
