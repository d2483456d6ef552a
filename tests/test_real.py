"""The real model tier (``-m real``): Gemma 3 270M, a GGUF file from the package index,
imported by ``worker import-gguf``'s code and run on every path.

The import is checked against llama.cpp itself (``tests/data/gemma3_270m_llamacpp.json``,
made by ``bench/llamacpp_reference.py`` from the same file): the same token ids, the
same next token at every position, logits within llama.cpp's own rounding (it multiplies
quantized weights by activations quantized to 8 bits; our import dequantizes the weights
and computes in float32), perplexity within 10%. Then the checks a random model cannot
pass: a factual answer, perplexity in the tens on English prose, and a 4-bit copy as
draft that agrees with the float target on most tokens.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import jsonschema
import mlx.core as mx
import numpy as np
import pytest

from schemas import ChatRequest
from tests.conftest import run_jobs
from tests.test_logprobs import TOL
from worker.engine.generator import ChatGenerator
from worker.engine.models import ModelCache
from worker.schedule.policy import SpeculationPolicy

pytestmark = pytest.mark.real
ROOT = Path(__file__).resolve().parents[1]
REFERENCE = json.loads((Path(__file__).parent / "data" / "gemma3_270m_llamacpp.json").read_text())
PROSE = (
    "Bread is one of the oldest prepared foods. Evidence from thirty thousand years ago in "
    "Europe shows that people ground the roots of plants into flour, mixed it with water "
    "and baked it on hot stones. Later, farmers grew wheat and barley, and bakers learned "
    "to let the dough rise before they put it into an oven."
)


@pytest.fixture(scope="module")
def gemma():
    from worker.gguf.bundled import NotInstalled, ensure

    try:
        return ensure(ROOT / ".mlxq" / "models")  # imported once per checkout, as the demo does
    except NotInstalled as e:
        pytest.fail(f"{e} (or deselect this tier with -m 'not real')")


@pytest.fixture(scope="module")
def loaded(gemma):
    from mlx_lm import load

    return load(str(gemma.target))


def _logits(model, ids: list[int]) -> np.ndarray:
    return np.array(model(mx.array([ids]))[0].astype(mx.float32))


def _perplexity(logits: np.ndarray, ids: list[int]) -> float:
    top = logits.max(-1, keepdims=True)
    logp = logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))
    return math.exp(-np.mean([logp[i, ids[i + 1]] for i in range(len(ids) - 1)]))


def test_the_import_agrees_with_llama_cpp(gemma, loaded):
    assert gemma.sha256 == REFERENCE["file_sha256"]
    model, tok = loaded
    for probe in REFERENCE["tokenize"]:  # whitespace runs, code, digits, CJK, emoji, turns
        assert tok.encode(probe["text"], add_special_tokens=False) == probe["ids"]
    for ref in REFERENCE["prompts"]:
        assert tok.encode(ref["text"]) == ref["ids"]
        logits = _logits(model, ref["ids"])
        top = np.array(ref["top_ids"])
        assert np.mean(logits.argmax(-1) == top[:, 0]) >= 0.95
        gap = np.abs(np.take_along_axis(logits, top, -1) - np.array(ref["top_logits"]))
        assert gap.mean() < 0.5, gap.mean()
        ppl = _perplexity(logits, ref["ids"])
        assert abs(ppl / ref["perplexity"] - 1) < 0.10, (ppl, ref["perplexity"])


def test_it_is_a_real_language_model(gemma, loaded):
    """Perplexity in the tens on English prose (a random 262k-vocabulary model scores
    ~262,000) and a factual answer only a trained model gives."""
    model, tok = loaded
    ids = tok.encode(PROSE)
    assert _perplexity(_logits(model, ids), ids) < 30
    gen = ChatGenerator.get_or_create(str(gemma.target), cache=ModelCache())
    req = {"messages": [{"role": "user", "content": "What is the capital of France?"}]}
    out = gen.generate(_req(gemma, **req, max_tokens=12))
    assert "Paris" in out.text
    assert "user:" not in out.text  # the transcript's next turn ends a base model's answer
    assert out.finish_reason in ("stop", "length")


def _req(gemma, **fields) -> ChatRequest:
    return ChatRequest.model_validate(
        {"model": str(gemma.target), "temperature": 0, "max_tokens": 16} | fields
    )


QUESTIONS = ["What is the capital of France?", "What do bees make?"]
SYSTEM = {
    "role": "system",
    "content": "You answer questions about the world in one short sentence. " * 6,
}


def test_every_path_gives_the_text_of_the_job_alone(conn, redis_url, gemma):
    """Alone, a continuous batch, speculative with the 4-bit draft (always and auto),
    streamed and n = 2, through a real worker, with a shared system prompt: the same
    greedy text on every path, and the prefix reused."""

    def job(i: int, **fields) -> dict:
        messages = [SYSTEM, {"role": "user", "content": QUESTIONS[i]}]
        return (
            {"model": str(gemma.target), "messages": messages, "max_tokens": 12}
            | {"temperature": 0}
            | fields
        )

    n = len(QUESTIONS)
    cache = ModelCache()  # loaded once for every path (each restores the kept prefix)
    jobs = {f"q{i}": job(i) for i in range(n)}
    plain = run_jobs(conn, redis_url, jobs, "real-alone", cache=cache)
    texts = {c: r.response.choices[0].message.content for c, r in plain.items()}
    assert "Paris" in texts["q0"]
    cached = [r.response.usage.prompt_tokens_details.cached_tokens for r in plain.values()]
    assert cached[0] == 0 and cached[1] > 0  # the shared system prompt was prefilled once
    draft = str(gemma.draft)
    variants = {
        "batch": ({}, n, "auto"),
        "spec-always": ({"draft_model": draft}, n, "always"),
        "spec-auto": ({"draft_model": draft}, 1, "auto"),
        "stream": ({"stream": True}, 1, "auto"),
        "n": ({"n": 2}, 1, "auto"),
    }
    accepted = proposed = 0
    for name, (fields, max_batch, mode) in variants.items():
        got = run_jobs(
            conn,
            redis_url,
            {f"q{i}": job(i, **fields) for i in range(n)},
            f"real-{name}",
            max_batch=max_batch,
            policy=SpeculationPolicy(mode),
            cache=cache,
        )
        for c, r in got.items():
            assert r.status == "succeeded", (name, c, r.error)
            contents = [ch.message.content for ch in r.response.choices]
            assert contents == [texts[c]] * len(contents), name
            if name == "spec-always":
                m = r.metrics
                accepted += m.draft_tokens_accepted
                proposed += m.draft_tokens_proposed
    assert proposed > 0 and accepted / proposed > 0.6  # a real pair: the 4-bit copy agrees


def test_speculative_logprobs_match_plain(gemma):
    cache = ModelCache(prefix_bytes=0)
    req = _req(gemma, messages=[{"role": "user", "content": "Name three colours."}], logprobs=True)
    req = req.model_copy(update={"top_logprobs": 3})
    plain = ChatGenerator.get_or_create(str(gemma.target), cache=cache).generate(req)
    gen = ChatGenerator.get_or_create(str(gemma.target), str(gemma.draft), cache=cache)
    spec = gen.generate(req.model_copy(update={"draft_model": str(gemma.draft)}))
    assert spec.token_ids == plain.token_ids and spec.draft_tokens_accepted > 0
    assert plain.logprobs is not None and spec.logprobs is not None
    for (t, lp, top), (u, lq, toq) in zip(spec.logprobs, plain.logprobs, strict=True):
        assert t == u and abs(lp - lq) < TOL
        assert [i for i, _ in top] == [i for i, _ in toq]


SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "country": {"type": "string", "maxLength": 20},
    },
    "required": ["city", "country"],
    "additionalProperties": False,
}


def test_response_format_over_the_262k_vocabulary(gemma):
    """The grammar mask over Gemma's 262,144 tokens: valid JSON of the schema, alone and
    with the draft (its proposals under the same mask), the same text both ways."""
    fmt = {"type": "json_schema", "json_schema": {"name": "place", "schema": SCHEMA}}
    msg = [{"role": "user", "content": "Where is the Eiffel Tower? Answer in JSON."}]
    req = _req(gemma, messages=msg, response_format=fmt, max_tokens=40)
    cache = ModelCache(prefix_bytes=0)
    plain = ChatGenerator.get_or_create(str(gemma.target), cache=cache).generate(req)
    gen = ChatGenerator.get_or_create(str(gemma.target), str(gemma.draft), cache=cache)
    spec = gen.generate(req.model_copy(update={"draft_model": str(gemma.draft)}))
    assert spec.text == plain.text
    assert plain.finish_reason == "stop", plain.text
    jsonschema.validate(json.loads(plain.text), SCHEMA)


def test_quantized_kv_caches_keep_its_perplexity(loaded):
    """Gemma 3 270M's global layers quantized (its sliding windows are not): the perplexity
    of held-out prose through 8-bit KV caches within 1% of unquantized, 4-bit within 5%;
    most greedy tokens unchanged (``bench.kvquant``)."""
    from bench.kvquant import perplexity

    got = perplexity(*loaded)
    assert abs(got[8]["vs_16"] - 1) < 0.01, got
    assert abs(got[4]["vs_16"] - 1) < 0.05, got
    assert got[8]["greedy_agreement"] >= 0.95 and got[4]["greedy_agreement"] >= 0.8, got
