"""A thinking budget: a reasoning model's thinking block is closed for it after the budget's
tokens, and the answer follows within ``max_tokens``, on every path a job takes.

The tiny reasoning model's template opens ``<think>`` in the prompt; a bias against
``</think>`` keeps it from ever writing it by itself (checked): without a budget every
token is reasoning. The budget's forced marker overrides the bias (only it is left).
"""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from producer import Client
from schemas import ChatRequest
from tests.conftest import chat, run_jobs, run_worker
from tests.test_reasoning import end_id, thinker  # noqa: F401 (fixtures)
from tests.waiting import seconds
from worker.engine.models import ModelCache
from worker.engine.reasoning import Budget
from worker.runner import runtime
from worker.schedule.policy import SpeculationPolicy

PROMPTS = ["think about the queue", "and the worker", "the draft model", "a batch of jobs"]
BUDGET = 6


@pytest.fixture
def never(end_id) -> dict:  # noqa: F811
    """A bias that keeps the model from closing its thinking block by itself."""
    return {"logit_bias": {str(end_id): -100}}


def _jobs(model, never: dict, max_tokens: int = 30, **fields) -> dict:
    return {
        f"t{i}": chat(
            str(model), content=p, temperature=0, max_tokens=max_tokens, **never, **fields
        )
        for i, p in enumerate(PROMPTS)
    }


def _parts(records: dict) -> dict:
    out = {}
    for cid, r in records.items():
        assert r.status == "succeeded", (cid, r.error)
        msg = r.response.choices[0].message
        details = r.response.usage.completion_tokens_details
        out[cid] = (msg.reasoning_content, msg.content, details.reasoning_tokens)
    return out


def test_without_a_budget_the_tiny_model_only_thinks(conn, redis_url, thinker, never):  # noqa: F811
    free = _parts(run_jobs(conn, redis_url, _jobs(thinker, never), "free"))
    for reasoning, content, thought in free.values():
        assert reasoning and not content and thought == 30  # never closed: all reasoning


def test_the_budget_closes_the_thinking_on_every_path(conn, redis_url, thinker, never):  # noqa: F811
    alone = _parts(
        run_jobs(conn, redis_url, _jobs(thinker, never, thinking_budget=BUDGET), "alone")
    )
    for reasoning, content, thought in alone.values():
        assert thought == BUDGET + 1  # the budget's tokens, then the end marker
        assert reasoning and content  # the answer follows
    batched = run_jobs(
        conn, redis_url, _jobs(thinker, never, thinking_budget=BUDGET), "b", max_batch=4
    )
    assert max(r.metrics.batch_size for r in batched.values()) > 1
    assert _parts(batched) == alone
    lookup = run_jobs(
        conn,
        redis_url,
        _jobs(thinker, never, thinking_budget=BUDGET, speculation={"method": "prompt_lookup"}),
        "lookup",
        max_batch=4,
        policy=SpeculationPolicy("always"),
    )
    assert all(r.metrics.speculative for r in lookup.values())
    assert _parts(lookup) == alone
    n = run_jobs(
        conn,
        redis_url,
        {
            "n": chat(
                str(thinker),
                content=PROMPTS[0],
                max_tokens=30,
                n=3,
                thinking_budget=BUDGET,
                **never,
            )
        },
        "n",
    )["n"]
    assert all(c.message.content for c in n.response.choices)  # each sampled choice answers
    s = Client(connection=conn).submit(
        _jobs(thinker, never, thinking_budget=BUDGET, stream=True), batch_id="s"
    )
    run_worker(redis_url, runtime=runtime.WorkerRuntime(cache=ModelCache(), worker_id="s"))
    client = Client(connection=conn)
    for cid, job_id in zip(alone, s.job_ids, strict=True):
        got = "".join(client.stream(job_id, timeout=seconds(10)))
        assert got == alone[cid][1]  # the streamed answer (reasoning goes apart)


def test_effort_and_the_workers_default_set_budgets(conn, redis_url, thinker, never):  # noqa: F811
    none = _parts(run_jobs(conn, redis_url, _jobs(thinker, never, reasoning_effort="none"), "none"))
    for reasoning, content, thought in none.values():
        assert not reasoning and content and thought == 1  # closed at once
    by_worker = _parts(
        run_jobs(conn, redis_url, _jobs(thinker, never), "default", thinking_budget=BUDGET)
    )
    alone = _parts(
        run_jobs(conn, redis_url, _jobs(thinker, never, thinking_budget=BUDGET), "alone2")
    )
    assert by_worker == alone
    mine = _parts(
        run_jobs(
            conn, redis_url, _jobs(thinker, never, thinking_budget=2), "own", thinking_budget=BUDGET
        )
    )
    assert all(thought == 3 for _, _, thought in mine.values())  # the request's own wins


def test_a_grammar_applies_to_the_answer_after_the_budget(conn, redis_url, thinker, never):  # noqa: F811
    labels = ["queue", "worker", "batch"]
    records = _parts(
        run_jobs(
            conn,
            redis_url,
            _jobs(thinker, never, thinking_budget=BUDGET, guided_choice=labels),
            "choice",
        )
    )
    for reasoning, content, thought in records.values():
        assert thought == BUDGET + 1 and reasoning
        assert content in labels


def test_the_forced_marker_of_several_tokens_is_finished():
    budget = Budget(tokens=3, start_ids=(7,), end_ids=(4, 5), in_reasoning=False)
    p = budget.processor()
    assert p.forced([1, 2]) is None  # not thinking
    assert p.forced([7, 1, 2]) is None  # within the budget
    assert p.forced([7, 1, 2, 3]) == 4  # spent: the marker begins
    assert p.forced([7, 1, 2, 3, 4]) == 5  # and is finished
    assert p.forced([7, 1, 2, 3, 4, 5]) is None  # closed: the answer is free
    inside = Budget(tokens=0, start_ids=(7,), end_ids=(4,), in_reasoning=True)
    assert inside.processor().forced([]) == 4  # 0: closed at once


def test_a_bad_budget_is_refused():
    with pytest.raises(ValidationError, match="thinking_budget"):
        ChatRequest.model_validate(chat("m", thinking_budget=-1))
