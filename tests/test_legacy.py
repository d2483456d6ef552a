"""Legacy ``/v1/completions``: a chat job with ``raw_prompt`` (no chat template) on every
path, and the gateway's translation to ``text_completion`` through the official SDK."""

from __future__ import annotations

import openai
import pytest
from pydantic import ValidationError

from schemas import ChatRequest
from tests.conftest import chat, run_jobs
from tests.test_gateway import gateway  # noqa: F401 (a fixture)
from worker.schedule.policy import SpeculationPolicy

PROMPT = "The queue worker said"


def _direct(model: str, max_tokens: int) -> tuple[str, int]:
    """mlx-lm's own greedy continuation of the raw prompt, and the prompt's token count."""
    from mlx_lm import generate, load

    m, tok = load(model)
    ids = tok.encode(PROMPT)
    return generate(m, tok, prompt=ids, max_tokens=max_tokens), len(ids)


def test_raw_prompts_continue_the_text_on_every_path(conn, redis_url, tiny):
    want, n_prompt = _direct(tiny.target, 12)
    assert want  # the random model writes something here (no EOS first)
    raw = chat(tiny.target, content=PROMPT, raw_prompt=True, max_tokens=12, temperature=0)
    jobs = {f"j{i}": raw for i in range(3)}
    alone = run_jobs(conn, redis_url, jobs, "raw-alone", max_batch=1)
    batched = run_jobs(conn, redis_url, jobs, "raw-batched", max_batch=4)
    drafted = run_jobs(
        conn,
        redis_url,
        {"d": raw | {"draft_model": tiny.draft, "num_draft_tokens": 2}},
        "raw-drafted",
        policy=SpeculationPolicy("always"),
    )
    for record in [*alone.values(), *batched.values(), *drafted.values()]:
        assert record.status == "succeeded", record.error
        assert record.response.choices[0].message.content == want
        assert record.response.usage.prompt_tokens == n_prompt  # no template around it
    templated = run_jobs(
        conn, redis_url, {"t": chat(tiny.target, content=PROMPT, max_tokens=2)}, "t"
    )
    assert templated["t"].response.usage.prompt_tokens > n_prompt


def test_raw_prompt_is_one_user_message_without_tools():
    for fields, words in [
        ({"messages": [{"role": "user", "content": "a"}] * 2}, "exactly one user message"),
        ({"messages": [{"role": "system", "content": "a"}]}, "exactly one user message"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "no tools"),
    ]:
        body = chat("m", raw_prompt=True) | fields
        with pytest.raises(ValidationError, match=words):
            ChatRequest.model_validate(body)


def test_the_sdk_gets_text_completions_plain_streamed_and_refused(gateway, workers, tiny):  # noqa: F811
    gw = gateway()
    client = gw.client()
    workers()
    want, n_prompt = _direct(tiny.target, 8)
    got = client.completions.create(model=tiny.target, prompt=PROMPT, max_tokens=8, temperature=0)
    assert got.object == "text_completion" and got.id.startswith("cmpl-")
    assert got.choices[0].text == want and got.usage.prompt_tokens == n_prompt
    streamed = client.completions.create(
        model=tiny.target, prompt=PROMPT, max_tokens=8, temperature=0, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed if c.choices) == want
    two = client.completions.create(
        model=tiny.target, prompt=[PROMPT], max_tokens=4, n=2, temperature=0.8, seed=3
    )
    assert [c.index for c in two.choices] == [0, 1]
    for fields, words in [
        ({"echo": True}, "echo"),
        ({"suffix": "x"}, "suffix"),
        ({"logprobs": 2}, "logprobs"),
        ({"best_of": 3}, "best_of"),
        ({"prompt": ["a", "b"]}, "one prompt"),
    ]:
        body = {"model": tiny.target, "prompt": PROMPT} | fields
        with pytest.raises(openai.BadRequestError, match=words):
            client.completions.create(**body)
