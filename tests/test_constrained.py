"""Constrained output beyond JSON (vLLM's ``structured_outputs``: a regex, a choice of
strings, a lark grammar; and its older ``guided_*`` fields), on every path a job takes.

The tiny models have random weights: their free text matches none of these (checked),
so every match below is the mask's doing.
"""

from __future__ import annotations

import re

import pytest
from pydantic import ValidationError

from producer import Client
from schemas import ChatRequest
from schemas.structured import MAX_CHOICES
from tests.conftest import chat, run_jobs, run_worker
from tests.waiting import seconds
from worker.engine.models import ModelCache
from worker.runner import runtime
from worker.schedule.policy import SpeculationPolicy

PROMPTS = [f"job {i}: label the queue {'worker ' * i}" for i in range(6)]
DATE = r"20[0-9]{2}-(0[1-9]|1[0-2])-[0-3][0-9]"
LABELS = ["urgent", "normal", "spam", "needs a human"]
#: A small language: a sum of one-to-three-digit numbers, ended by "=".
LARK = 'start: num (" + " num)* " ="\nnum: /[1-9][0-9]{0,2}/'
SUM = re.compile(r"[1-9][0-9]{0,2}( \+ [1-9][0-9]{0,2})* =")
CASES = {
    "regex": ({"structured_outputs": {"regex": DATE}}, lambda t: re.fullmatch(DATE, t)),
    "choice": ({"structured_outputs": {"choice": LABELS}}, lambda t: t in LABELS),
    "grammar": ({"structured_outputs": {"grammar": LARK}}, lambda t: SUM.fullmatch(t)),
    "guided_choice": ({"guided_choice": LABELS}, lambda t: t in LABELS),
}


def _jobs(model: str, fields: dict, **more) -> dict:
    return {
        f"c{i}": chat(model, content=p, max_tokens=40, temperature=0, **fields, **more)
        for i, p in enumerate(PROMPTS)
    }


def _texts(records: dict) -> dict:
    out = {}
    for cid, r in records.items():
        assert r.status == "succeeded", (cid, r.error)
        choice = r.response.choices[0]
        out[cid] = (choice.message.content, choice.finish_reason)
    return out


@pytest.mark.parametrize("kind", list(CASES))
def test_the_output_matches_alone_batched_speculative_streamed_and_n(conn, redis_url, tiny, kind):
    fields, matches = CASES[kind]
    alone = _texts(run_jobs(conn, redis_url, _jobs(tiny.target, fields), f"alone-{kind}"))
    done = [t for t, reason in alone.values() if reason == "stop"]
    assert len(done) >= 4 and all(matches(t) for t in done), alone  # (most end in 40 tokens)
    free = _texts(run_jobs(conn, redis_url, _jobs(tiny.target, {}), f"free-{kind}"))
    assert not any(matches(t) for t, _ in free.values())  # not the model's own doing
    batched = run_jobs(conn, redis_url, _jobs(tiny.target, fields), f"b-{kind}", max_batch=6)
    assert max(r.metrics.batch_size for r in batched.values()) > 1
    assert _texts(batched) == alone
    for how in ({"draft_model": tiny.draft}, {"speculation": {"method": "prompt_lookup"}}):
        spec = run_jobs(
            conn,
            redis_url,
            _jobs(tiny.target, fields, **how),
            f"spec-{kind}-{len(how)}-{next(iter(how))}",
            max_batch=4,
            policy=SpeculationPolicy("always"),
        )
        assert all(r.metrics.speculative for r in spec.values()), how
        assert _texts(spec) == alone, how
    sampled = run_jobs(  # n = 3 sampled choices: each matches
        conn,
        redis_url,
        {"n": chat(tiny.target, content=PROMPTS[0], max_tokens=40, temperature=1.0, n=3, **fields)},
        f"n-{kind}",
    )["n"]
    for choice in sampled.response.choices:
        assert choice.finish_reason != "stop" or matches(choice.message.content), choice
    s = Client(connection=conn).submit(
        _jobs(tiny.target, fields, stream=True), batch_id=f"s-{kind}"
    )
    run_worker(redis_url, runtime=runtime.WorkerRuntime(cache=ModelCache(), worker_id="s"))
    client = Client(connection=conn)
    for cid, job_id in zip(alone, s.job_ids, strict=True):
        assert "".join(client.stream(job_id, timeout=seconds(10))) == alone[cid][0]


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({"structured_outputs": {"regex": "[a-"}}, "structured_outputs.regex: cannot be enforced"),
        ({"guided_regex": "(?=a)b"}, "guided_regex: cannot be enforced"),  # (no look-around)
        ({"structured_outputs": {"grammar": 'root ::= "a"'}}, "GBNF"),
        ({"structured_outputs": {"grammar": "start: nowhere"}}, "unknown name"),
        ({"structured_outputs": {"choice": []}}, "give 1 to"),
        ({"guided_choice": ["a"] * (MAX_CHOICES + 1)}, "give 1 to"),
        ({"guided_choice": ["ok", ""]}, "non-empty"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "exactly one"),
        ({"structured_outputs": {"xml": "<a/>"}}, "xml"),
        ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "give one"),
        ({"guided_regex": "a", "stop": ["x"]}, "stop cannot be combined"),
        ({"guided_regex": "a", "json_whitespace": "indented"}, "json_whitespace"),
        ({"structured_outputs": {"regex": "a" * 70_000}}, "bytes; at most"),
    ],
)
def test_bad_constraints_are_refused_naming_the_field(fields, expected):
    with pytest.raises(ValidationError, match=re.escape(expected)):
        ChatRequest.model_validate(chat("m", **fields))


def test_a_json_schema_by_structured_outputs_is_response_formats_grammar():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    by_so = ChatRequest.model_validate(chat("m", structured_outputs={"json": schema}))
    by_rf = ChatRequest.model_validate(
        chat(
            "m",
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
        )
    )
    assert by_so.grammar == by_rf.grammar is not None


def _direct(model: str, prompt: str, max_tokens: int, **penalties) -> str:
    """mlx-lm's own greedy continuation of a raw prompt with its own logits processors."""
    from mlx_lm import generate, load
    from mlx_lm.sample_utils import make_logits_processors

    m, tok = load(model)
    processors = make_logits_processors(**penalties)
    return generate(
        m, tok, prompt=tok.encode(prompt), max_tokens=max_tokens, logits_processors=processors
    )


@pytest.mark.parametrize("size", [20, 6])
def test_repetition_penalty_is_mlx_lms_on_every_path(conn, redis_url, tiny, size):
    """The penalty changes the text (greedy), and the text is mlx-lm's own with the same
    processor: alone, batched, with a draft and by prompt lookup."""
    prompt = "The queue worker said"
    penalty = {"repetition_penalty": 1.8, "repetition_context_size": size}
    want = _direct(tiny.target, prompt, 24, **penalty)
    assert want != _direct(tiny.target, prompt, 24)  # (it can fail: the penalty does something)
    raw = chat(
        tiny.target, content=prompt, raw_prompt=True, max_tokens=24, temperature=0, **penalty
    )
    paths = {
        "alone": ({}, 1),
        "batched": ({}, 4),
        "draft": ({"draft_model": tiny.draft}, 4),
        "lookup": ({"speculation": {"method": "prompt_lookup"}}, 1),
    }
    for name, (how, max_batch) in paths.items():
        jobs = {f"{name}{i}": raw | how for i in range(3 if max_batch > 1 else 1)}
        policy = SpeculationPolicy("always" if how else "never")
        records = run_jobs(
            conn, redis_url, jobs, f"rep-{size}-{name}", max_batch=max_batch, policy=policy
        )
        for record in records.values():
            assert record.status == "succeeded", record.error
            assert record.response.choices[0].message.content == want, name


def test_repetition_penalty_is_refused_out_of_range():
    for value, words in [(0, "greater than 0"), (11, "less than or equal to 10")]:
        with pytest.raises(ValidationError, match=words):
            ChatRequest.model_validate(chat("m", repetition_penalty=value))
    with pytest.raises(ValidationError, match="repetition_context_size"):
        ChatRequest.model_validate(chat("m", repetition_context_size=0))


def test_min_tokens_keeps_the_end_away_on_every_path(conn, redis_url, tiny):
    """Greedy jobs that end early (EOS) write at least ``min_tokens`` tokens with it, the
    same tokens alone, batched and speculative."""
    eos = {"logit_bias": {"3": 4.0}}  # (the tiny models' EOS, favoured: they end at once)
    asks = {
        f"m{i}": chat(tiny.target, content=p, max_tokens=48, temperature=0, **eos)
        for i, p in enumerate(PROMPTS)
    }
    free = run_jobs(conn, redis_url, asks, "min-free")
    short = {
        c: r.response.usage.completion_tokens
        for c, r in free.items()
        if r.response.choices[0].finish_reason == "stop"
    }
    assert short and min(short.values()) < 16, short  # (it can fail: some end early)
    floor = {c: asks[c] | {"min_tokens": 16} for c in short}
    paths = {
        "alone": ({}, 1, "never"),
        "batched": ({}, 4, "never"),
        "draft": ({"draft_model": tiny.draft}, 4, "always"),
        "lookup": ({"speculation": {"method": "prompt_lookup"}}, 1, "always"),
    }
    seen = {}
    for name, (how, max_batch, policy) in paths.items():
        jobs = {c: body | how for c, body in floor.items()}
        records = run_jobs(
            conn,
            redis_url,
            jobs,
            f"min-{name}",
            max_batch=max_batch,
            policy=SpeculationPolicy(policy),
        )
        seen[name] = {}
        for c, r in records.items():
            assert r.status == "succeeded", r.error
            assert r.response.usage.completion_tokens >= 16, (name, c)
            seen[name][c] = r.response.choices[0].message.content
    assert seen["batched"] == seen["draft"] == seen["lookup"] == seen["alone"]
    with pytest.raises(ValidationError, match="min_tokens"):
        ChatRequest.model_validate(chat("m", min_tokens=50, max_tokens=10))


def test_xtc_excludes_top_choices_seeded_the_same_alone_and_in_n(conn, redis_url, tiny):
    """XTC with probability 1 and threshold 0 leaves only the least likely token (and the
    newline and end tokens it never excludes): the text changes; a seed gives the same
    text again. Speculation is refused by name, and a worker's prompt lookup never
    applies to it."""
    asks = {
        "plain": chat(tiny.target, max_tokens=16, temperature=1.0, seed=7),
        "xtc": chat(
            tiny.target,
            max_tokens=16,
            temperature=1.0,
            seed=7,
            xtc_probability=1.0,
            xtc_threshold=0.0,
        ),
    }
    asks["again"] = asks["xtc"]
    policy = SpeculationPolicy("always", lookup="always")  # (XTC jobs still do not speculate)
    records = run_jobs(conn, redis_url, asks, "xtc", policy=policy)
    texts = {c: r.response.choices[0].message.content for c, r in records.items()}
    assert texts["xtc"] != texts["plain"] and texts["xtc"] == texts["again"]
    assert not records["xtc"].metrics.speculative
    for how in ({"draft_model": "d"}, {"speculation": {"method": "prompt_lookup"}}):
        with pytest.raises(ValidationError, match="xtc_probability cannot be combined"):
            ChatRequest.model_validate(chat("m", xtc_probability=0.5, **how))
    with pytest.raises(ValidationError, match="xtc_threshold"):
        ChatRequest.model_validate(chat("m", xtc_probability=0.5, xtc_threshold=0.7))


def test_a_grammar_that_is_complete_ends_the_output_before_min_tokens(conn, redis_url, tiny):
    """min_tokens bans the end only while anything else is allowed: a choice written in
    two tokens ends there (before: every token masked, the job failed outside its grammar)."""
    asks = _jobs(tiny.target, {"guided_choice": LABELS, "min_tokens": 20})
    for cid, r in run_jobs(conn, redis_url, asks, "min-choice", max_batch=4).items():
        assert r.status == "succeeded", (cid, r.error)
        assert r.response.choices[0].message.content in LABELS
