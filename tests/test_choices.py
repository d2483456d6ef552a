"""n > 1: several choices of one prompt, one prefill, decoded together as a batch."""

from __future__ import annotations

import json

import jsonschema
import pytest

from schemas import ChatRequest
from tests.conftest import chat, run_jobs
from tests.test_schemas import error_of
from tests.test_structured import SCHEMA, schema_format
from worker.engine.generator import ChatGenerator
from worker.engine.models import ModelCache

NO_EOS = {"3": -100}  # the tiny models' EOS: banned, so every choice runs to max_tokens


def _texts(record) -> list[str]:
    assert record.status == "succeeded", record.error
    return [c.message.content for c in record.response.choices]


def test_seeded_choices_are_reproducible_and_usage_adds_up(conn, redis_url, tiny):
    job = chat(tiny.target, max_tokens=12, temperature=1.0, seed=7, n=4, logit_bias=NO_EOS)
    first = run_jobs(conn, redis_url, {"a": job}, "first")["a"]
    again = run_jobs(conn, redis_url, {"a": job}, "again", max_batch=4)["a"]
    assert [c.index for c in first.response.choices] == [0, 1, 2, 3]
    assert _texts(first) == _texts(again)  # choice i reproducible
    assert len(set(_texts(first))) > 1  # they are samples, not copies
    usage = first.response.usage
    assert usage.completion_tokens == 4 * 12
    assert usage.total_tokens == usage.prompt_tokens + 4 * 12
    assert first.metrics.batch_size == 4
    other = run_jobs(conn, redis_url, {"a": job | {"seed": 8}}, "other")["a"]
    assert _texts(other) != _texts(first)


def test_greedy_choices_equal_the_single_answer(conn, redis_url, tiny):
    one = chat(tiny.target, content="hello there", max_tokens=16, temperature=0)
    records = run_jobs(
        conn, redis_url, {"one": one, "three": one | {"n": 3}}, "greedy", max_batch=4
    )
    (single,) = _texts(records["one"])
    assert _texts(records["three"]) == [single] * 3


def test_choices_join_a_batch_and_sample_what_they_sample_alone(conn, redis_url, tiny):
    """A job's n choices are n sequences of a running batch: seeded, each samples what it
    samples alone, and ``batch_size`` counts every sequence it decoded with."""
    job = chat(tiny.target, max_tokens=10, temperature=0.9, seed=3, n=3, logit_bias=NO_EOS)
    alone = run_jobs(conn, redis_url, {"a": job}, "n-alone")["a"]
    others = {f"o{i}": chat(tiny.target, content=f"other {i}", max_tokens=10) for i in range(3)}
    batched = run_jobs(conn, redis_url, {**others, "a": job}, "n-batched", max_batch=8)
    assert _texts(batched["a"]) == _texts(alone) and len(set(_texts(alone))) > 1
    assert batched["a"].metrics.batch_size >= 4 and alone.metrics.batch_size == 3
    assert batched["a"].response.usage.completion_tokens == 3 * 10


def test_choices_wait_for_as_many_places_first_in_first_out(conn, redis_url, tiny):
    """A job of 4 choices under ``--max-batch 4`` joins once 4 places are free; the job
    behind it waits behind it (nothing overtakes a job waiting for places). One of 6
    choices, more than the cap, runs once the batch is empty."""
    jobs = {
        "long": chat(tiny.target, content="a long one", max_tokens=24, logit_bias=NO_EOS),
        "four": chat(tiny.target, max_tokens=4, n=4, logit_bias=NO_EOS),
        "after": chat(tiny.target, content="after", max_tokens=4, logit_bias=NO_EOS),
        "six": chat(tiny.target, max_tokens=4, n=6, seed=1, temperature=1.0, logit_bias=NO_EOS),
    }
    got = run_jobs(conn, redis_url, jobs, "n-places", max_batch=4)
    assert got["long"].metrics.batch_size == 1  # "four" did not fit beside it, nor "after"
    assert got["four"].metrics.batch_size == 4
    order = [r.custom_id for r in sorted(got.values(), key=lambda r: r.finished_at)]
    assert order == ["long", "four", "after", "six"]
    assert len(got["six"].response.choices) == 6 and got["six"].metrics.batch_size == 6


def test_choices_with_a_schema_and_logprobs(conn, redis_url, tiny):
    job = chat(
        tiny.target,
        max_tokens=160,
        temperature=0.7,
        seed=1,
        n=3,
        response_format=schema_format(),
        logprobs=True,
        top_logprobs=2,
    )
    record = run_jobs(conn, redis_url, {"a": job}, "fmt")["a"]
    finished = 0
    for choice in record.response.choices:
        assert choice.logprobs is not None and choice.logprobs.content
        assert all(t.logprob <= 0 for t in choice.logprobs.content)
        if choice.finish_reason == "stop":
            jsonschema.validate(json.loads(choice.message.content), SCHEMA)
            finished += 1
    assert finished >= 1


def test_the_prompt_is_prefilled_once_for_all_choices(tiny):
    gen = ChatGenerator.get_or_create(tiny.target, cache=ModelCache())
    model = gen.target.model
    widths: list[int] = []
    inner = type(model).__call__

    class Counting(type(model)):
        def __call__(self, inputs, *args, **kwargs):
            widths.append(inputs.shape[-1])
            return inner(self, inputs, *args, **kwargs)

    model.__class__ = Counting
    try:
        req = ChatRequest.model_validate(
            chat(tiny.target, content="a prompt of some length " * 4, max_tokens=5, n=6, seed=1)
        )
        out = gen.generate_choices(req)
    finally:
        model.__class__ = Counting.__mro__[1]
    assert len(out.others) == 5
    assert sum(1 for w in widths if w > 1) == 1  # one prefill pass, not six
    assert out.completion_tokens == sum(len(o.token_ids) for o in (out, *out.others)) == 30


def test_a_draft_with_n_decodes_plainly_and_says_why(conn, redis_url, tiny):
    """Alone or in a plain batch beside another job (its choices decode plainly)."""
    job = chat(tiny.target, max_tokens=6, temperature=0, n=2, draft_model=tiny.draft)
    r = run_jobs(conn, redis_url, {"a": job}, "draft")["a"]
    assert len(_texts(r)) == 2
    assert not r.metrics.speculative and "n=2" in r.metrics.speculation_reason
    other = chat(tiny.target, content="another", max_tokens=6, temperature=0)
    got = run_jobs(conn, redis_url, {"o": other, "a": job}, "draft-batched", max_batch=4)
    assert _texts(got["a"]) == _texts(r) and got["a"].metrics.batch_size == 3
    assert not got["a"].metrics.speculative and "n=2" in got["a"].metrics.speculation_reason


@pytest.mark.parametrize("max_batch", [1, 4])
def test_n_above_the_workers_cap_fails_with_a_400(conn, redis_url, tiny, max_batch):
    """Alone, or taken into a running batch: the job fails by name, the others run."""
    jobs = {
        "first": chat(tiny.target, content="first", max_tokens=8),
        "big": chat(tiny.target, n=5, max_tokens=2),
        "ok": chat(tiny.target, max_tokens=2),
    }
    records = run_jobs(conn, redis_url, jobs, f"cap{max_batch}", max_batch=max_batch, max_n=4)
    assert records["big"].status_code == 400 and "--max-n 4" in records["big"].error.message
    assert records["ok"].status == "succeeded" and records["first"].status == "succeeded"
    assert records["ok"].metrics.batch_size == (2 if max_batch == 4 else 1)


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({"n": 0}, "n: Input should be greater than or equal to 1"),
        ({"n": 129}, "n: Input should be less than or equal to 128"),
        ({"n": 2, "stream": True}, "n > 1 cannot be streamed yet"),
        ({"n": "two"}, "n: Input should be a valid integer"),
    ],
)
def test_bad_n_is_refused(fields, expected):
    assert expected in error_of(chat("m", **fields))
