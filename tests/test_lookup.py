"""Prompt lookup: speculation without a draft model, on every path.

The index (longest n-gram first, its latest occurrence, a copy goes on where it is),
the request field and its hostile values, the engines alone and batched (greedy text
equal to plain decoding), and real worker paths. A "quoting" tiny model
(``TinySpec.quote``: its greedy output replays the end of its prompt) is what a
copy-heavy job looks like: most proposals are accepted.
"""

from __future__ import annotations

import json
import zlib

import jsonschema
import pytest
from pydantic import ValidationError

from producer import Client
from schemas import ChatRequest, keys
from schemas.request import MAX_PROPOSAL
from schemas.store import read_result
from tests.conftest import chat, run_jobs, run_worker
from tests.test_structured import SCHEMA, schema_format
from worker.dev.tinymodels import TinySpec, ensure_model
from worker.engine.generator import ChatGenerator
from worker.engine.lookup import Lookup, NgramIndex, lookup_for
from worker.engine.models import ModelCache
from worker.engine.specbatch import SpecBatchEngine
from worker.runner import runtime
from worker.schedule.goodput import Goodput
from worker.schedule.policy import LOOKUP, PLAIN, JobSpeed, SpeculationPolicy

QUOTE = 32  # the quoting model replays its context from this many tokens back
TEXT = (
    "order 4411 ships to berlin on monday with two crates of apples and a box of pears "
    "for the market on the river road"
)
LOOKUP_JOB = {"method": "prompt_lookup"}


@pytest.fixture(scope="module")
def quoting(tmp_path_factory) -> str:
    spec = TinySpec(layers=2, hidden=128, intermediate=256, heads=1, kv_heads=1, quote=QUOTE)
    return str(ensure_model(tmp_path_factory.mktemp("quoting") / "m", spec))


def _req(model: str, content: str = TEXT, **fields) -> ChatRequest:
    fields = {"max_tokens": 40, "temperature": 0} | fields
    return ChatRequest.model_validate(chat(model, content=content, **fields))


def _gen(model: str) -> ChatGenerator:
    return ChatGenerator.get_or_create(model, cache=ModelCache(prefix_bytes=0))


def _both(model: str, req: ChatRequest, k: int = 6):
    """The job decoded plainly and by prompt lookup (k per round), alone."""
    gen = _gen(model)
    job = gen.prepare(req)
    plain = gen.generate(job, use_draft=False)
    looked = gen.generate(job.with_params(num_draft_tokens=k), lookup=job.params.lookup)
    return plain, looked


# -- the index -----------------------------------------------------------------
def test_the_longest_ngram_wins_then_its_latest_occurrence():
    index = NgramIndex(Lookup(1, 3, 8), [1, 2, 3, 9, 9, 5, 2, 3, 7, 7, 1, 2, 3])
    assert index.propose(8) == [9, 9, 5, 2, 3, 7, 7, 1]  # (1, 2, 3) occurred at the start
    index = NgramIndex(Lookup(1, 3, 8), [4, 2, 3, 9, 5, 2, 3, 7, 6, 2, 3])
    assert index.propose(2) == [7, 6]  # (2, 3) twice: the later one; capped at 2
    assert NgramIndex(Lookup(2, 3, 8), [1, 2, 3, 4, 5]).propose(8) == []  # nothing repeats
    assert NgramIndex(Lookup(1, 1, 3), [5, 6, 7, 5]).propose(8) == [6, 7, 5]  # num_tokens 3


def test_a_copy_goes_on_from_its_span_while_the_sequence_follows_it():
    # "k v" repeats, as keys do in structured text: the span being copied decides.
    prompt = [1, 8, 9, 2, 8, 9, 3, 8, 9, 4, 0, 1, 8]
    index = NgramIndex(Lookup(2, 2, 3), prompt)
    assert index.propose(3) == [9, 2, 8]  # (1, 8) occurred once: copy from there
    index.sync([*prompt, 9, 2, 8])  # the target wrote what was proposed
    assert index.propose(3) == [9, 3, 8]  # the span goes on (not the latest "8 9" ...)
    index.sync([*prompt, 9, 2, 8, 9, 3, 8, 5])  # it wrote 5: the copy ends there
    assert index.propose(3) == []  # (8, 5) never occurred


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"ngram_min": 0}, "ngram_min"),
        ({"ngram_max": 17}, "ngram_max"),
        ({"num_tokens": 65}, "num_tokens"),
        ({"ngram_min": 5, "ngram_max": 3}, "ngram_min 5 is larger than ngram_max 3"),
        ({"method": "medusa"}, "method"),
        ({"method": "draft", "num_tokens": 4}, "apply to method prompt_lookup only"),
        ({"ngram": 3}, "ngram"),
    ],
)
def test_hostile_lookup_settings_are_refused_by_name(fields, match):
    body = chat("m") | {"speculation": {"method": "prompt_lookup"} | fields}
    with pytest.raises(ValidationError, match=match):
        ChatRequest.model_validate(body)
    with pytest.raises(ValueError, match="ngram_min"):
        Lookup(0, 4, 8)


def test_the_field_in_extra_params_and_what_contradicts_it():
    req = ChatRequest.model_validate(chat("m") | {"extra_params": {"speculation": LOOKUP_JOB}})
    assert req.speculation_method == "prompt_lookup"
    assert lookup_for(req.speculation) == Lookup()
    assert lookup_for(
        ChatRequest.model_validate(
            chat("m") | {"speculation": {"method": "prompt_lookup", "ngram_max": 1}}
        ).speculation
    ) == Lookup(1, 1, MAX_PROPOSAL)
    with pytest.raises(ValidationError, match="contradict"):
        ChatRequest.model_validate(chat("m", draft_model="d") | {"speculation": LOOKUP_JOB})
    with pytest.raises(ValidationError, match="no draft_model"):
        ChatRequest.model_validate(chat("m") | {"speculation": {"method": "draft"}})


# -- the engines ------------------------------------------------------------------
def test_a_job_that_quotes_its_prompt_accepts_most_proposals(quoting):
    plain, looked = _both(quoting, _req(quoting))
    assert looked.token_ids == plain.token_ids and looked.text == plain.text
    assert len(looked.text) > 30 and TEXT.endswith(looked.text)  # it quoted the prompt
    assert looked.draft_tokens_accepted >= 0.8 * looked.draft_tokens_proposed > 0
    assert looked.draft_tokens_accepted >= 0.6 * looked.completion_tokens  # few target rounds


def test_rejected_proposals_leave_the_greedy_text_as_it_was(tiny):
    """A random model does not copy: what lookup proposes from a repetitive prompt is
    mostly rejected, and the target's cache is cut back each time."""
    content = "job batch job batch job batch queue job batch"
    req = _req(tiny.target, content, speculation={"method": "prompt_lookup", "ngram_min": 1})
    plain, looked = _both(tiny.target, req, k=4)
    assert looked.token_ids == plain.token_ids
    assert looked.draft_rejections > 0


def test_nothing_to_copy_proposes_nothing_and_each_miss_is_a_plain_round(tiny):
    req = _req(tiny.target, content="alpha", max_tokens=6)
    gen = _gen(tiny.target)
    job = gen.prepare(req)
    plain = gen.generate(job, use_draft=False)
    looked = gen.generate(job, lookup=Lookup(4, 4, 8))  # 4-grams: the short text has none
    assert looked.token_ids == plain.token_ids
    assert looked.draft_tokens_proposed == 0 and looked.idle_rounds == looked.completion_tokens


def test_logprobs_and_a_schema_under_lookup_match_plain(quoting, tiny):
    from tests.test_logprobs import TOL

    plain, looked = _both(quoting, _req(quoting, logprobs=True, top_logprobs=2))
    assert looked.token_ids == plain.token_ids and looked.draft_tokens_accepted > 0
    assert plain.logprobs is not None and looked.logprobs is not None
    for (t, lp, top), (u, lq, toq) in zip(looked.logprobs, plain.logprobs, strict=True):
        assert t == u and abs(lp - lq) < TOL
        assert [i for i, _ in top] == [i for i, _ in toq]
    # A schema masks what the target may choose; proposals outside it are rejected.
    req = _req(tiny.target, content=TEXT, response_format=schema_format(), max_tokens=60)
    plain, looked = _both(tiny.target, req)
    assert looked.text == plain.text
    if plain.finish_reason == "stop":
        jsonschema.validate(json.loads(looked.text), SCHEMA)


@pytest.mark.parametrize("planner", [False, True])
def test_a_lookup_batch_with_joins_and_leaves_equals_each_job_alone(quoting, tiny, planner):
    from tests.test_specbatch import _run_engine

    for model in (quoting, tiny.target):
        gen = _gen(model)
        reqs = [
            _req(model, f"{TEXT} {i} " + "crate " * i, max_tokens=8 + 7 * (i % 4)) for i in range(6)
        ]
        engine = SpecBatchEngine(gen.target, None, 4, Goodput(4, 0.5) if planner else None)
        assert engine.models == (gen.target,)  # no draft model, no draft cache
        outs, sizes = _run_engine(engine, gen, reqs)
        assert max(sizes) >= 3
        for i, r in enumerate(reqs):
            plain, alone = _both(model, r, k=4)
            assert outs[i].token_ids == plain.token_ids, (model, i)
            if not planner:  # the same proposals and acceptances as alone
                got = (outs[i].draft_tokens_proposed, outs[i].draft_tokens_accepted)
                assert got == (alone.draft_tokens_proposed, alone.draft_tokens_accepted), i
        if model == quoting and not planner:  # (a planner may choose plain rounds)
            accepted = sum(o.draft_tokens_accepted for o in outs.values())
            assert accepted >= 0.5 * sum(o.completion_tokens for o in outs.values())


# -- the worker -------------------------------------------------------------------
def _texts(records: dict) -> dict:
    return {c: [ch.message.content for ch in r.response.choices] for c, r in records.items()}


def test_every_worker_path_with_prompt_lookup_gives_the_plain_text(conn, redis_url, quoting):
    """Alone, batched (fixed k and auto), streamed, n = 2 and with logprobs, through a
    real worker and Redis: each job's text is the plain job's; speculative jobs say
    how they speculated."""

    def job(i: int, **fields) -> dict:
        return chat(quoting, f"{TEXT} {i} " + "crate " * (i % 3), max_tokens=24, temperature=0)

    plain = run_jobs(conn, redis_url, {f"j{i}": job(i) for i in range(4)}, "lookup-plain")
    texts = {c: r.response.choices[0].message.content for c, r in plain.items()}
    variants = {
        "alone": ({}, 1, "auto"),
        "batch": ({}, 4, "always"),
        "batch-auto": ({}, 4, "auto"),
        "stream": ({"stream": True}, 4, "always"),
        "n": ({"n": 2}, 1, "always"),
        "logprobs": ({"logprobs": True}, 4, "always"),
    }
    for name, (fields, max_batch, mode) in variants.items():
        jobs = {f"j{i}": job(i) | fields | {"speculation": LOOKUP_JOB} for i in range(4)}
        got = run_jobs(conn, redis_url, jobs, f"lookup-{name}", max_batch, SpeculationPolicy(mode))
        for c, r in got.items():
            assert r.status == "succeeded", (name, c, r.error)
            assert _texts(got)[c] == [texts[c]] * len(r.response.choices), name
            m = r.metrics
            if name == "n":  # the choices decode as one batch, plainly, and say so
                assert not m.speculative and "n=2" in m.speculation_reason
            elif mode == "always":
                assert m.speculative and m.speculation_method == "prompt_lookup", name
                assert m.draft_model is None and m.draft_tokens_accepted > 0, name
        if name == "stream":  # streamed jobs share a lookup batch
            assert all(r.metrics.batch_size > 1 for r in got.values())


def test_the_workers_lookup_mode_decides_for_jobs_that_do_not_say(conn, redis_url, quoting):
    jobs = {
        "unsaid": chat(quoting, TEXT, max_tokens=16, temperature=0),
        "off": chat(quoting, TEXT, max_tokens=16, temperature=0)
        | {"speculation": {"method": "none"}},
    }
    never = run_jobs(conn, redis_url, jobs, "mode-never", policy=SpeculationPolicy("auto"))
    assert all(r.metrics.speculation_reason is None for r in never.values())
    always = run_jobs(
        conn, redis_url, jobs, "mode-always", policy=SpeculationPolicy("auto", lookup="always")
    )
    assert always["unsaid"].metrics.speculation_method == "prompt_lookup"
    assert not always["off"].metrics.speculative  # "none" is never overridden
    assert _texts(always) == _texts(never)


def test_a_hostile_lookup_payload_in_redis_fails_alone_and_others_run(conn, redis_url, tiny):
    client = Client(connection=conn)
    jobs = [chat(tiny.target, f"job {i}", max_tokens=3, temperature=0) for i in range(3)]
    sub = client.submit(jobs, batch_id="hostile-lookup")
    bad = sub.job_ids[1]
    key = keys.rq_job_key(bad)
    func, inst, (envelope,), kw = json.loads(zlib.decompress(conn.hget(key, "data")))
    envelope["request"]["speculation"] = {"method": "prompt_lookup", "ngram_max": 99}
    conn.hset(key, "data", zlib.compress(json.dumps([func, inst, [envelope], kw]).encode()))
    rt = runtime.WorkerRuntime(cache=ModelCache(), worker_id="hostile-lookup")
    run_worker(redis_url, runtime=rt, max_batch=4)
    records = [read_result(conn, j) for j in sub.job_ids]
    assert records[1].status == "failed" and records[1].error.code == "invalid_request"
    assert "speculation.ngram_max" in records[1].error.message
    assert [r.status for r in (records[0], records[2])] == ["succeeded"] * 2


# -- the policy -------------------------------------------------------------------
def test_auto_measures_lookup_like_a_draft_and_drops_it_when_it_loses():
    policy = SpeculationPolicy("auto", lookup="auto", lookup_k=4)
    req = ChatRequest.model_validate(chat("t"))
    assert policy.proposer(req) == LOOKUP
    none = ChatRequest.model_validate(chat("t") | {"speculation": {"method": "none"}})
    assert policy.proposer(none) is None
    assert SpeculationPolicy("auto").proposer(req) is None  # --lookup never
    fixed = ChatRequest.model_validate(
        chat("t") | {"speculation": {"method": "prompt_lookup", "num_tokens": 5}}
    )
    assert policy.fixed_k(fixed) == 5
    assert "speculation.num_tokens fixed" in policy.choose("t", LOOKUP, 5).reason
    chosen = []
    for _ in range(6):  # free text: every round a miss (an idle round counts as a rejection)
        d = policy.choose("t", LOOKUP)
        chosen.append(d.k)
        speed = JobSpeed(51, 50 * 0.05) if d.k == PLAIN else JobSpeed(51, 50 * 0.055, 0, 50)
        policy.record("t", LOOKUP, d, speed)
    assert chosen[:2] == [PLAIN, 4]  # plain, then k; 2k skipped: k's measurements bound it
    assert chosen[2:] == [PLAIN] * 4
