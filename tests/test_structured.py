"""response_format: JSON output enforced by a token mask, on every path a job can take.

The tiny models have random weights: free text from them is never JSON, so every
parse below is the constraint's doing (one test shows the same prompts unconstrained).
"""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest

from producer import Client
from schemas import ChatRequest, keys
from schemas.job import job_data
from schemas.store import read_result
from schemas.structured import MAX_SCHEMA_BYTES
from tests.conftest import chat, run_jobs, run_worker
from tests.test_schemas import error_of
from tests.waiting import seconds
from worker.engine.models import ModelCache
from worker.runner import runtime
from worker.schedule.policy import SpeculationPolicy

SCHEMA = {
    "type": "object",
    "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "count": {"type": "integer", "minimum": 3, "maximum": 7},
        "size": {
            "type": "object",
            "properties": {"w": {"type": "integer"}, "h": {"type": "number"}},
            "required": ["w"],
            "additionalProperties": False,
        },
        "tags": {
            "type": "array",
            "items": {"type": "string", "maxLength": 6},
            "minItems": 1,
            "maxItems": 2,
        },
        "ok": {"type": "boolean"},
    },
    "required": ["color", "count", "size", "tags"],
    "additionalProperties": False,
}
PROMPTS = [f"job {i}: describe the queue {'worker ' * i}" for i in range(8)]


def schema_format(schema=SCHEMA) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "thing", "schema": schema}}


def _jobs(model, fmt, *, max_tokens=160, **fields) -> dict:
    return {
        f"c{i}": chat(
            model, content=p, max_tokens=max_tokens, temperature=0, response_format=fmt, **fields
        )
        for i, p in enumerate(PROMPTS)
    }


def _check_valid(records: dict, schema=SCHEMA) -> int:
    """Every finished output parses and validates; the number that finished."""
    stopped = 0
    for cid, r in records.items():
        assert r.status == "succeeded", (cid, r.error)
        choice = r.response.choices[0]
        if choice.finish_reason == "stop":
            jsonschema.validate(json.loads(choice.message.content), schema)
            stopped += 1
    return stopped


def _texts(records: dict) -> dict[str, tuple[str, str]]:
    return {
        c: (r.response.choices[0].message.content, r.response.choices[0].finish_reason)
        for c, r in records.items()
    }


def test_schema_is_enforced_alone_batched_speculative_and_streamed(conn, redis_url, tiny):
    fmt = schema_format()
    alone = run_jobs(conn, redis_url, _jobs(tiny.target, fmt), "alone")
    assert _check_valid(alone) >= 4  # not a vacuous pass: most finish (digits run on)
    assert all(r.metrics.batch_size == 1 for r in alone.values())

    # Batched, among unconstrained jobs of the same model: the same greedy text.
    mixed = _jobs(tiny.target, fmt) | {
        f"free{i}": chat(tiny.target, content=p, max_tokens=40, temperature=0)
        for i, p in enumerate(PROMPTS[:4])
    }
    batched = run_jobs(conn, redis_url, mixed, "batched", max_batch=6)
    constrained = {c: r for c, r in batched.items() if not c.startswith("free")}
    assert max(r.metrics.batch_size for r in constrained.values()) > 1
    assert _texts(constrained) == _texts(alone)
    for c, r in batched.items():  # the free jobs stay free text (random model: not JSON)
        if c.startswith("free"):
            with pytest.raises(ValueError):
                json.loads(r.response.choices[0].message.content)

    # With a draft: proposals are masked too, and verified; greedy output is unchanged.
    for draft in (tiny.draft, tiny.twin):
        spec = run_jobs(
            conn,
            redis_url,
            _jobs(tiny.target, fmt, draft_model=draft),
            f"spec-{Path(draft).name}",
            policy=SpeculationPolicy("always"),
        )
        assert all(r.metrics.speculative for r in spec.values())
        assert _texts(spec) == _texts(alone)
        if draft == tiny.twin:  # the same model: every masked proposal is accepted (but
            for r in spec.values():  # those after EOS in the last round, counted proposed)
                m = r.metrics
                assert 0 <= m.draft_tokens_proposed - m.draft_tokens_accepted < 3, m

    # Streamed: the pieces concatenate to the same JSON.
    s = Client(connection=conn).submit(_jobs(tiny.target, fmt, stream=True), batch_id="streamed")
    run_worker(redis_url, runtime=runtime.WorkerRuntime(cache=ModelCache(), worker_id="s"))
    client = Client(connection=conn)
    for cid, job_id in zip(_jobs(tiny.target, fmt), s.job_ids, strict=True):
        assert (
            "".join(client.stream(job_id, timeout=seconds(10)))
            == alone[cid].response.choices[0].message.content
        )


def test_unconstrained_output_of_the_same_prompts_is_not_json(conn, redis_url, tiny):
    free = run_jobs(conn, redis_url, _jobs(tiny.target, {"type": "text"}), "free")
    for r in free.values():
        with pytest.raises(ValueError):
            json.loads(r.response.choices[0].message.content)


def _vocab(model: str) -> dict[str, int]:
    return json.loads((Path(model) / "tokenizer.json").read_text())["model"]["vocab"]


def test_json_object_gives_a_json_object(conn, redis_url, tiny):
    # Free-form keys never end on a random model; a bias towards '"' and '}' lets them
    # end (the mask still decides what is valid: a bias cannot lift a masked token).
    vocab = _vocab(tiny.target)
    bias = {str(vocab['"']): 4, str(vocab["}"]): 4}
    jobs = _jobs(tiny.target, {"type": "json_object"}, logit_bias=bias)
    records = run_jobs(conn, redis_url, jobs, "obj")
    stopped = 0
    for r in records.values():
        choice = r.response.choices[0]
        if choice.finish_reason == "stop":
            assert isinstance(json.loads(choice.message.content), dict)
            stopped += 1
    assert stopped >= 6


def test_budget_ending_inside_the_json_is_finish_reason_length(conn, redis_url, tiny):
    records = run_jobs(conn, redis_url, _jobs(tiny.target, schema_format(), max_tokens=6), "short")
    for r in records.values():
        choice = r.response.choices[0]
        assert choice.finish_reason == "length"
        assert r.response.usage.completion_tokens == 6
        assert choice.message.content.startswith("{")
        with pytest.raises(ValueError):
            json.loads(choice.message.content)


def test_a_real_vocabulary_byte_level_bpe(conn, redis_url, bpe):
    """The 32k byte-level tokenizer (llguidance reads it directly; the tiny models'
    Metaspace one goes through mlxq's byte table): batched and alone agree."""
    model = bpe
    # A random model writes digits without end in compact JSON (no whitespace to end a
    # number on): a bias towards ',' and '}' lets numbers end (the mask still decides).
    vocab = _vocab(model)
    bias = {str(vocab[","]): 3, str(vocab["}"]): 3}
    jobs = _jobs(model, schema_format(), max_tokens=200, logit_bias=bias)
    alone = run_jobs(conn, redis_url, jobs, "bpe-alone")
    batched = run_jobs(conn, redis_url, jobs, "bpe-batched", max_batch=8)
    assert _check_valid(alone) >= 3
    assert _texts(batched) == _texts(alone)


@pytest.mark.parametrize(
    ("fmt", "expected"),
    [
        (
            schema_format({"type": "array", "uniqueItems": True}),
            'cannot be enforced: Unimplemented keys: ["uniqueItems"]',
        ),
        (schema_format({"not": {"type": "string"}}), 'Unimplemented keys: ["not"]'),
        (schema_format({"type": "bogus"}), "Invalid type: bogus"),
        (schema_format({"$ref": "#/defs/x"}), "does not exist"),
        ({"type": "json_schema"}, "type json_schema needs a json_schema object"),
        ({"type": "json_object", "json_schema": {"name": "x", "schema": {}}}, "takes no"),
        ({"type": "xml"}, "response_format.type"),
        ({"type": "json_schema", "json_schema": {"name": "a b", "schema": {}}}, "name"),
        ({"type": "json_schema", "json_schema": {"name": "x"}}, "schema: Field required"),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": 5}}, "schema"),
        (
            schema_format({"type": "object", "description": "x" * MAX_SCHEMA_BYTES}),
            f"at most {MAX_SCHEMA_BYTES}",
        ),
    ],
)
def test_bad_response_formats_are_refused_naming_the_problem(fmt, expected):
    assert expected in error_of(chat("m", response_format=fmt))


def test_stop_strings_and_a_json_format_are_refused_together():
    assert "stop cannot be combined" in error_of(
        chat("m", stop=["}"], response_format={"type": "json_object"})
    )
    req = ChatRequest.model_validate(chat("m", stop=["x"], response_format={"type": "text"}))
    assert req.grammar is None


@pytest.mark.parametrize("max_batch", [1, 4])
def test_a_job_hash_with_an_unenforceable_schema_fails_with_a_400_naming_it(
    conn, redis_url, tiny, max_batch
):
    """A producer validates the schema; a job hash written by anything else is checked
    again by the worker, alone or batched, and fails without stopping the others."""
    jobs = {"bad": chat(tiny.target), "good": chat(tiny.target, max_tokens=4, temperature=0)}
    s = Client(connection=conn).submit(jobs, batch_id="h")
    bad_id = s.job_ids[0]
    body = chat(tiny.target, response_format=schema_format({"not": {"type": "string"}}))
    conn.hset(keys.rq_job_key(bad_id), "data", job_data("bad", 1.0, body, 3600))
    run_worker(redis_url, runtime=runtime.WorkerRuntime(cache=ModelCache()), max_batch=max_batch)
    bad, good = read_result(conn, bad_id), read_result(conn, s.job_ids[1])
    assert bad.status == "failed" and bad.error.code == "invalid_request"
    assert bad.status_code == 400
    assert 'cannot be enforced: Unimplemented keys: ["not"]' in bad.error.message
    assert good.status == "succeeded"


# -- the processor and its guard, directly -------------------------------------------


@pytest.fixture(scope="module")
def loaded(tiny):
    from mlx_lm import load

    return load(tiny.target)


def _allowed(processor, history: list[int], width: int = 512) -> set[int]:
    import mlx.core as mx
    import numpy as np

    out = processor(mx.array(history, mx.uint32), mx.zeros((1, width)))
    return set(np.nonzero(np.isfinite(np.array(out[0])))[0].tolist())


def test_the_mask_follows_a_history_that_rewinds(loaded, tiny):
    """Speculative decoding shows the processor continuations and then takes them back:
    each mask equals the mask of a fresh matcher fed the same history."""
    from worker.engine.constrain import constraint_for

    _, tok = loaded
    req = ChatRequest.model_validate(chat(tiny.target, response_format=schema_format()))
    c = constraint_for(req, tok, 512)
    doc = tok.encode('{"color": "green", "count": 5')
    doc = doc[1:] if tok.convert_ids_to_tokens(doc[0]) == "▁" else doc
    prompt = [7, 8, 9]

    def fresh(n: int) -> set[int]:
        p = c.processor()
        _allowed(p, prompt)
        return _allowed(p, prompt + doc[:n])

    p = c.processor()
    assert _allowed(p, prompt) == fresh(0)
    for n in (1, 2, 5, 3, 9, 4, 4, 12, 0, len(doc)):  # forwards, back, forwards again
        assert _allowed(p, prompt + doc[:n]) == fresh(n), n
    assert fresh(0) == {tok.convert_tokens_to_ids("{")}


def test_special_tokens_are_never_text_inside_a_string(loaded, tiny):
    from worker.dev.tinymodels import SPECIAL_TOKENS
    from worker.engine.constrain import constraint_for

    _, tok = loaded
    req = ChatRequest.model_validate(chat(tiny.target, response_format={"type": "json_object"}))
    p = constraint_for(req, tok, 512).processor()
    _allowed(p, [1])
    inside = _allowed(p, [1, *tok.encode('{"')[-2:]])
    vocab = _vocab(tiny.target)
    assert len(inside) > 100  # ordinary text is allowed inside the key
    assert inside.isdisjoint(vocab[s] for s in SPECIAL_TOKENS)


def test_verify_refuses_output_outside_the_grammar(loaded, tiny):
    from schemas import GenerationError
    from worker.engine.constrain import constraint_for, verify

    _, tok = loaded
    req = ChatRequest.model_validate(chat(tiny.target, response_format={"type": "json_object"}))
    c = constraint_for(req, tok, 512)
    whole = tok.encode("{}")[-2:]
    eos = next(iter(c.eos))
    verify(c, [*whole, eos], "stop")  # complete
    verify(c, whole[:1], "length")  # a prefix, cut by the budget
    with pytest.raises(GenerationError, match="at token 0 of"):
        verify(c, tok.encode("hello"), "length")
    with pytest.raises(GenerationError):
        verify(c, [*whole[:1], eos], "stop")  # ended before the JSON did
    # The same grammar, compiled once per tokenizer:
    assert constraint_for(req, tok, 512).prototype is c.prototype


def test_mask_covers_logits_wider_than_the_vocabulary():
    import mlx.core as mx
    import numpy as np

    from worker.engine.constrain import mask_logits

    bits = np.zeros(2, np.int32)
    bits.view(np.uint32)[1] = np.uint32(1 << 31)  # token 63 only
    out = np.array(mask_logits(mx.zeros((1, 80)), bits)[0])
    assert np.nonzero(np.isfinite(out))[0].tolist() == [63]


def test_a_request_object_is_stored_in_openai_shape(conn, tiny):
    """Client.submit of a ChatRequest stores `response_format.json_schema.schema` (OpenAI's
    key), which any other reader of the job hash expects."""
    import zlib

    req = ChatRequest.model_validate(chat(tiny.target, response_format=schema_format()))
    s = Client(connection=conn).submit({"x": req}, batch_id="shape")
    raw = conn.hget(keys.rq_job_key(s.job_ids[0]), "data")
    body = json.loads(zlib.decompress(raw))[2][0]["request"]
    assert body["response_format"]["json_schema"]["schema"] == SCHEMA


# -- the order of properties, and the whitespace between tokens ------------------------

#: Required properties in an order that is not alphabetical: the output writes them so.
ORDERED = {
    "type": "object",
    "properties": {
        "reasoning": {"type": "string", "maxLength": 12},
        "answer": {"type": "integer", "minimum": 0, "maximum": 99},
        "confidence": {"enum": ["low", "high"]},
    },
    "required": ["reasoning", "answer", "confidence"],
    "additionalProperties": False,
}


def _gaps(text: str) -> list[str]:
    """The runs of whitespace outside JSON strings, each with the character before it."""
    gaps, inside, escaped, run = [], False, False, ""
    for i, ch in enumerate(text):
        if inside:
            inside = escaped or ch != '"'
            escaped = not escaped and ch == "\\"
        elif ch in " \n\r\t":
            run += ch
            continue
        elif ch == '"':
            inside = True
        if run:
            gaps.append(text[i - len(run) - 1] + run)
            run = ""
    return gaps + ([text[-len(run) - 1] + run] if run else [])


def test_gaps_reads_whitespace_outside_strings_only():
    assert _gaps('{"a b": [1, 2],\n  "c\\" d":"e"}') == [": ", ", ", ",\n  "]


def test_properties_come_in_the_schema_order_on_every_path(conn, redis_url, tiny):
    """Read from the raw content (a parse would lose the order): alone, batched, with a
    draft and by prompt lookup (in a batch), the first key is the schema's first, not
    the alphabet's."""
    fmt = schema_format(ORDERED)
    jobs = _jobs(tiny.target, fmt, max_tokens=60)
    paths = {
        "alone": run_jobs(conn, redis_url, jobs, "o-alone"),
        "batched": run_jobs(conn, redis_url, jobs, "o-batched", max_batch=8),
        "draft": run_jobs(
            conn,
            redis_url,
            _jobs(tiny.target, fmt, max_tokens=60, draft_model=tiny.draft),
            "o-draft",
            policy=SpeculationPolicy("always"),
        ),
        "lookup": run_jobs(
            conn,
            redis_url,
            _jobs(tiny.target, fmt, max_tokens=60, speculation={"method": "prompt_lookup"}),
            "o-lookup",
            max_batch=8,
            policy=SpeculationPolicy("always"),
        ),
    }
    for path, records in paths.items():
        assert _texts(records) == _texts(paths["alone"]), path
        for r in records.values():
            content = r.response.choices[0].message.content
            assert content.startswith('{"reasoning":"'), (path, content)
            positions = [content.find(f'"{k}"') for k in ORDERED["properties"]]
            found = [p for p in positions if p >= 0]
            assert found == sorted(found) and found[0] == 1, (path, content)
    assert any(  # not vacuous: some reach the last key
        '"confidence":' in r.response.choices[0].message.content for r in paths["alone"].values()
    )


#: Whitespace as the two tokenizers spell it: Metaspace's and byte-level BPE's.
_WHITESPACE = set("▁\n\t\r ĠĊĉč")


def _whitespace_bias(model: str) -> dict[str, float]:
    """A logit bias that makes a model prefer whitespace tokens wherever the mask allows
    them (the failure a real model showed: gaps filled until max_tokens)."""
    vocab = _vocab(model)
    bias = {str(i): 8.0 for t, i in vocab.items() if t and set(t) <= _WHITESPACE}
    assert bias  # the tokenizer has whitespace tokens to prefer
    return bias


@pytest.fixture(scope="module")
def bpe(tmp_path_factory) -> str:
    """A byte-level BPE model of 32k entries (newlines and runs of indent are tokens)."""
    from worker.dev.tinymodels import TinySpec, ensure_model

    spec = TinySpec(layers=1, hidden=64, intermediate=128, vocab=32000, tokenizer="bpe32k")
    return str(ensure_model(tmp_path_factory.mktemp("bpe") / "bpe32k", spec))


@pytest.mark.parametrize("max_batch", [1, 8])
@pytest.mark.parametrize("which", ["tiny", "bpe"])
def test_compact_json_leaves_a_whitespace_loving_model_no_room(
    conn, redis_url, request, which, max_batch
):
    model = (
        request.getfixturevalue("tiny").target
        if which == "tiny"
        else request.getfixturevalue("bpe")
    )
    jobs = _jobs(model, schema_format(ORDERED), max_tokens=60, logit_bias=_whitespace_bias(model))
    records = run_jobs(conn, redis_url, jobs, f"compact-{which}{max_batch}", max_batch=max_batch)
    assert _check_valid(records, ORDERED) == len(jobs)  # each ends, within the budget
    for r in records.values():
        content = r.response.choices[0].message.content
        assert _gaps(content) == [], content


def test_indented_json_is_the_switch_for_models_that_write_newlines(conn, redis_url, bpe):
    fields = {"logit_bias": _whitespace_bias(bpe), "json_whitespace": "indented"}
    jobs = _jobs(bpe, schema_format(ORDERED), max_tokens=200, **fields)
    alone = run_jobs(conn, redis_url, jobs, "indented")
    batched = run_jobs(conn, redis_url, jobs, "indented-b", max_batch=8)
    assert _texts(batched) == _texts(alone)
    assert _check_valid(alone, ORDERED) >= 6
    newlines = 0
    for r in alone.values():
        for gap in _gaps(r.response.choices[0].message.content):
            ws = gap[1:]
            assert ws == " " or (ws[0] == "\n" and set(ws[1:]) <= {" ", "\t"}), repr(gap)
            assert len(ws) <= 33, repr(gap)
            newlines += ws[0] == "\n"
    assert newlines > 0  # the switch lets the model lay the JSON out on lines


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({"json_whitespace": "pretty", "response_format": {"type": "json_object"}}, "compact"),
        ({"json_whitespace": "indented"}, "json_whitespace lays out a JSON response_format"),
        (
            {"json_whitespace": "indented", "response_format": {"type": "text"}},
            "json_whitespace lays out",
        ),
    ],
)
def test_bad_json_whitespace_is_refused_naming_it(fields, expected):
    assert expected in error_of(chat("m", **fields))


@pytest.mark.parametrize("layout", ["compact", "indented"])
def test_a_schema_cannot_bring_its_own_whitespace(loaded, tiny, layout):
    """x-guidance options inside a job's schema do not loosen the layout: after the
    opening brace only the first key may follow, never the schema's own whitespace."""
    from worker.engine.constrain import constraint_for

    _, tok = loaded
    loose = ORDERED | {"x-guidance": {"whitespace_flexible": True, "whitespace_pattern": "▁+"}}
    fields = {"json_whitespace": layout} if layout == "indented" else {}
    req = ChatRequest.model_validate(
        chat(tiny.target, response_format=schema_format(loose), **fields)
    )
    p = constraint_for(req, tok, 512).processor()
    _allowed(p, [1])
    after_brace = _allowed(p, [1, tok.convert_tokens_to_ids("{")])
    space = tok.convert_tokens_to_ids("▁")
    assert (space in after_brace) == (layout == "indented")  # one space, in indented only
    assert tok.convert_tokens_to_ids('"') in after_brace


def test_the_mask_allows_only_tokens_the_grammar_accepts(loaded, tiny):
    """After a separator's space and a ``t`` as two tokens, the grammar forces ``rue``:
    the mask must allow the token that spells ``r``, not ``▁r`` (the tiny Metaspace
    tokenizer's fallback tokenized the forced text with its leading visible space, so
    llguidance allowed a token it then refused, and the job failed its replay)."""
    from worker.engine.constrain import constraint_for

    _, tok = loaded
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    fmt = schema_format(schema)
    cases = [
        ("indented", ["▁", "t"]),
        ("indented", ["▁t"]),
        ("indented", ["▁", "f", "a"]),
        ("compact", ["t"]),
        ("compact", ["f", "a"]),
    ]
    for layout, pieces in cases:
        fields = {"json_whitespace": layout}
        req = ChatRequest.model_validate(chat(tiny.target, response_format=fmt, **fields))
        c = constraint_for(req, tok, 512)
        body = [tok.convert_tokens_to_ids(p) for p in ["{", '"', "o", "k", '"', ":", *pieces]]
        m = c.matcher()
        assert m.try_consume_tokens(body) == len(body)
        p = c.processor()
        _allowed(p, [5])  # its first call: the prompt
        allowed = _allowed(p, [5, *body])
        refused = [t for t in allowed if m.deep_copy().try_consume_tokens([t]) != 1]
        assert allowed and not refused, (pieces, [tok.convert_ids_to_tokens(t) for t in refused])
