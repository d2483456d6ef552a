"""logprobs / top_logprobs: the target's log-probabilities, the same on every path."""

from __future__ import annotations

import json
import math

import mlx.core as mx
import pytest

from producer import Client
from producer.streams import iter_chunks
from schemas import ChatRequest
from schemas.store import read_result
from tests.conftest import chat, run_jobs, run_worker
from tests.test_schemas import error_of
from tests.waiting import seconds
from worker.engine import prompt_tokens
from worker.engine.generator import ChatGenerator
from worker.engine.models import ModelCache
from worker.runner import runtime
from worker.schedule.policy import SpeculationPolicy

PROMPTS = [f"job {i}: the queue {'worker ' * i}" for i in range(6)]
TOL = 1e-4


def _jobs(model, **fields) -> dict:
    body = {"max_tokens": 24, "temperature": 0, "logprobs": True, "top_logprobs": 5} | fields
    return {f"c{i}": chat(model, content=p, **body) for i, p in enumerate(PROMPTS)}


def _content(record) -> list:
    assert record.status == "succeeded", record.error
    return record.response.choices[0].logprobs.content


def _close(a: list, b: list) -> None:
    """Two logprob lists: the same tokens, values within TOL, the same top tokens."""
    assert [t.token for t in a] == [t.token for t in b]
    for x, y in zip(a, b, strict=True):
        assert abs(x.logprob - y.logprob) < TOL
        assert [t.token for t in x.top_logprobs] == [t.token for t in y.top_logprobs]
        for p, q in zip(x.top_logprobs, y.top_logprobs, strict=True):
            assert abs(p.logprob - q.logprob) < TOL


def test_greedy_logprobs_are_well_formed(conn, redis_url, tiny):
    records = run_jobs(conn, redis_url, _jobs(tiny.target), "shape")
    for r in records.values():
        content = _content(r)
        assert len(content) == r.response.usage.completion_tokens  # "length": every token
        for t in content:
            assert t.logprob <= 0 and len(t.top_logprobs) == 5
            values = [c.logprob for c in t.top_logprobs]
            assert values == sorted(values, reverse=True) and all(v <= 0 for v in values)
            assert t.top_logprobs[0].token == t.token  # greedy: the chosen one is the best
            assert abs(t.top_logprobs[0].logprob - t.logprob) < 1e-6
            assert bytes(t.bytes).decode("utf-8", "replace") == t.token
        text = "".join(t.token for t in content)
        assert text.strip() == r.response.choices[0].message.content.strip()


def test_values_equal_a_direct_forward_pass(tiny):
    """The engine's values are log_softmax of the model's logits on the same tokens."""
    gen = ChatGenerator.get_or_create(tiny.target, cache=ModelCache())
    req = ChatRequest.model_validate(
        chat(tiny.target, max_tokens=20, temperature=0.9, seed=3, logprobs=True, top_logprobs=3)
    )
    out = gen.generate(req)
    prompt = prompt_tokens(gen.target.tokenizer, req)
    ids = list(out.token_ids)
    logits = gen.target.model(mx.array([prompt + ids[:-1]]))[0, len(prompt) - 1 :]
    direct = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    assert len(out.logprobs) == len(ids)
    for pos, (token, logprob, top) in enumerate(out.logprobs):
        assert token == ids[pos]
        assert abs(logprob - direct[pos, token].item()) < TOL
        best = mx.argsort(-direct[pos])[:3].tolist()
        assert [i for i, _ in top] == best
    # Sampled at temperature 0.9: not always the top token, so the check is not trivial.
    assert any(token != top[0][0] for token, _, top in out.logprobs)


def test_equal_alone_batched_speculative_and_streamed(conn, redis_url, tiny):
    alone = run_jobs(conn, redis_url, _jobs(tiny.target), "alone")
    batched = run_jobs(conn, redis_url, _jobs(tiny.target), "batched", max_batch=6)
    assert max(r.metrics.batch_size for r in batched.values()) > 1
    for draft in (tiny.draft, tiny.twin):  # few accepted; all accepted
        spec = run_jobs(
            conn,
            redis_url,
            _jobs(tiny.target, draft_model=draft),
            f"spec-{draft.rsplit('/', 1)[-1]}",
            policy=SpeculationPolicy("always"),
        )
        assert all(r.metrics.speculative for r in spec.values())
        if draft == tiny.twin:  # accepted draft tokens carry the target's logprobs
            assert all(r.metrics.acceptance_rate == 1.0 for r in spec.values())
        for cid, r in alone.items():
            _close(_content(spec[cid]), _content(r))
    for cid, r in alone.items():
        _close(_content(batched[cid]), _content(r))

    s = Client(connection=conn).submit(_jobs(tiny.target, stream=True), batch_id="streamed")
    run_worker(redis_url, runtime=runtime.WorkerRuntime(cache=ModelCache(), worker_id="s"))
    for cid, job_id in zip(alone, s.job_ids, strict=True):
        chunks = list(iter_chunks(conn, job_id, timeout=seconds(10)))
        streamed = [
            t
            for c in chunks
            for choice in c["choices"]
            for t in ((choice.get("logprobs") or {}).get("content") or [])
        ]
        record = read_result(conn, job_id)
        assert streamed == [t.model_dump(mode="json") for t in _content(record)]
        _close(_content(record), _content(alone[cid]))


@pytest.mark.parametrize("max_batch", [1, 4])
def test_a_stop_string_keeps_only_the_tokens_of_the_text(conn, redis_url, tiny, max_batch):
    free = run_jobs(conn, redis_url, _jobs(tiny.target), "free")
    text = free["c0"].response.choices[0].message.content
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    jobs = {"c0": _jobs(tiny.target, stop=[stop])["c0"], "c1": _jobs(tiny.target)["c1"]}
    cut = run_jobs(conn, redis_url, jobs, "cut", max_batch)["c0"]
    assert cut.metrics.batch_size == min(max_batch, 2)  # alone, or batched with c1
    kept = cut.response.choices[0].message.content
    assert cut.response.choices[0].finish_reason == "stop" and stop not in kept
    content = _content(cut)
    assert "".join(t.token for t in content).strip().startswith(kept.strip())
    assert len(content) < len(_content(free["c0"]))
    if max_batch == 1:
        assert content == _content(free["c0"])[: len(content)]
    else:  # batched arithmetic: the same tokens, values within TOL
        _close(content, _content(free["c0"])[: len(content)])


def test_with_a_response_format_only_allowed_tokens_appear(conn, redis_url, tiny):
    fmt = {"type": "json_object"}
    records = run_jobs(
        conn, redis_url, _jobs(tiny.target, response_format=fmt, top_logprobs=20), "fmt"
    )
    for r in records.values():
        first = _content(r)[0]
        # The mask allows only "{" first: one alternative, log-probability 0.
        assert [t.token for t in first.top_logprobs] == ["{"]
        assert abs(first.logprob) < 1e-6
        assert all(math.isfinite(t.logprob) for t in _content(r))
    json.dumps([r.model_dump(mode="json") for r in records.values()], allow_nan=False)


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({"top_logprobs": 3}, "top_logprobs needs logprobs: true"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs: Input should be less than"),
        ({"logprobs": True, "top_logprobs": -1}, "top_logprobs: Input should be greater"),
        ({"logprobs": "maybe"}, "logprobs: Input should be a valid boolean"),
    ],
)
def test_bad_logprobs_fields_are_refused(fields, expected):
    assert expected in error_of(chat("m", **fields))
