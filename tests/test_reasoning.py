"""Reasoning models: the thinking apart from the answer on every path, template switches,
reasoning tokens counted, and a grammar that applies to the answer.

A tiny model whose template opens ``<think>`` in the prompt (as Qwen3.5's and
DeepSeek-R1's do), through the real ``mlx_lm.load``; a small bias on ``</think>`` makes
its greedy output think a few tokens, close the block, and answer.
"""

from __future__ import annotations

import json
import shutil

import pytest
from pydantic import ValidationError

from schemas import ChatRequest
from tests.conftest import chat, run_jobs
from tests.test_gateway import gateway  # noqa: F401 (a fixture)
from worker.dev.tinymodels import ensure_thinking_model
from worker.engine import reasoning
from worker.engine.models import ModelCache
from worker.engine.parser import split_reasoning
from worker.engine.request import prompt_tokens
from worker.schedule.policy import SpeculationPolicy

PROMPTS = ["think about the queue", "and the worker", "the draft model", "a batch of jobs"]
SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}},
    "required": ["ok"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def thinker(tmp_path_factory):
    return ensure_thinking_model(tmp_path_factory.mktemp("thinking") / "thinker")


@pytest.fixture(scope="module")
def end_id(thinker) -> int:
    entry, _ = ModelCache().get(str(thinker))
    (token,) = entry.tokenizer.encode("</think>", add_special_tokens=False)
    return int(token)


def body(model, content, end_id, bias=2.0, **fields) -> dict:
    return chat(
        str(model),
        content=content,
        temperature=0,
        max_tokens=40,
        logit_bias={str(end_id): bias},
        **fields,
    )


def parts(record) -> tuple[str | None, str, int]:
    assert record.status == "succeeded", record.error
    msg = record.response.choices[0].message
    details = record.response.usage.completion_tokens_details
    return msg.reasoning_content, msg.content, details.reasoning_tokens


@pytest.mark.parametrize(
    ("change", "word"),
    [
        ({"chat_template_kwargs": {"messages": []}}, "set by mlxq"),
        ({"chat_template_kwargs": {"add_generation_prompt": False}}, "set by mlxq"),
        ({"chat_template_kwargs": {"tools": []}}, "set by mlxq"),
        ({"chat_template_kwargs": {"not a name": 1}}, "template variable name"),
        ({"chat_template_kwargs": {f"k{i}": i for i in range(40)}}, "at most 32"),
        ({"chat_template_kwargs": {"big": "x" * 5000}}, "bytes"),
        ({"chat_template_kwargs": [1, 2]}, "chat_template_kwargs"),
        ({"reasoning_effort": "extreme"}, "reasoning_effort"),
    ],
)
def test_hostile_template_switches_are_refused_by_name(change, word):
    with pytest.raises(ValidationError, match=word):
        ChatRequest.model_validate(chat("m") | change)


def test_the_split_and_the_count():
    t = reasoning.Thinking("<think>", "</think>", (9,))
    assert split_reasoning("plan\n</think>\n\nanswer", t, True) == ("plan", "answer")
    assert split_reasoning("cut short", t, True) == ("cut short", "")
    assert split_reasoning("<think>a</think>b", t, False) == ("a", "b")
    assert split_reasoning("no thinking", t, False) == (None, "no thinking")
    assert split_reasoning("</think>only", t, True) == (None, "only")
    assert split_reasoning("<thi", t, False, final=False) == (None, None)  # may open a block
    assert split_reasoning("plan </thi", t, True, final=False) == ("plan", None)  # held
    assert reasoning.reasoning_tokens((1, 2, 9, 3), t, True) == 3
    assert reasoning.reasoning_tokens((1, 2), t, True) == 2  # never closed: all of it
    assert reasoning.reasoning_tokens((1, 2), t, False) == 0


@pytest.mark.parametrize("in_reasoning", [False, True])
def test_every_live_view_is_a_prefix_of_the_final_message(in_reasoning):
    """The one parser, fed a text piece by piece (every split point of several texts):
    each live view of the reasoning, the answer and each call's arguments is a prefix of
    the finished message's, so what a stream sends adds up to the record."""
    import json

    from mlx_lm.tool_parsers import json_tools

    from worker.engine.parser import OutputParser
    from worker.engine.toolcalls import Family

    t = reasoning.Thinking("<think>", "</think>", (9,))
    family = Family("json_tools", "<tool_call>", "</tool_call>", json_tools.parse_tool_call)
    call = (
        '<tool_call>\n{"name": "get_time", "arguments": {"zone": "utc", "n": [1, 2]}}\n</tool_call>'
    )
    opening = "" if in_reasoning else "<think>"
    texts = [
        f"{opening}weigh it </think>\n\nThe answer.  ",
        f"{opening} plan\n</think>Let me check. {call}",
        f"{opening}cut short <",
        "no thinking at all < <tool",
        f"{opening}x</think>{call}{call} and after",
    ]
    for text in texts:
        for cut in range(len(text) + 1):
            parser = OutputParser(t, in_reasoning, family)
            for piece in (text[:cut], text[cut:]):
                parser.feed(piece)
                live = parser.live()
                final = OutputParser(t, in_reasoning, family, text).message("stop")[0]
                assert (final.reasoning_content or "").startswith(live.reasoning or ""), text
                assert (final.content or "").startswith(live.content or ""), (text, cut)
                for n, (name, args) in enumerate(live.calls):
                    done = final.tool_calls[n].function
                    assert done.name == name and done.arguments.startswith(args), (text, cut)
            if "tool_call>" in text and text.endswith("</tool_call>"):
                calls = OutputParser(t, in_reasoning, family, text).message("stop")[0].tool_calls
                assert [json.loads(c.function.arguments)["zone"] for c in calls] == ["utc"]


def test_template_switches_reach_the_template(thinker):
    entry, _ = ModelCache().get(str(thinker))
    tok = entry.tokenizer

    def prompt(**fields) -> list[int]:
        return prompt_tokens(tok, ChatRequest.model_validate(chat(str(thinker)) | fields))

    assert reasoning.opens_in_reasoning(tok, prompt())
    off = prompt(chat_template_kwargs={"enable_thinking": False})
    assert not reasoning.opens_in_reasoning(tok, off)
    assert tok.decode(off).endswith("<think>\n\n</think>")
    assert "effort: low" in tok.decode(prompt(reasoning_effort="low"))
    assert "effort" not in tok.decode(prompt())


def test_reasoning_apart_from_the_answer_on_every_path(
    conn,
    redis_url,
    thinker,
    end_id,
    tmp_path,
    gateway,  # noqa: F811 (the fixture imported above)
    workers,
):
    jobs = {f"j{i}": body(thinker, p, end_id) for i, p in enumerate(PROMPTS)}
    alone = run_jobs(conn, redis_url, jobs, "alone", max_batch=1)
    batched = run_jobs(conn, redis_url, jobs, "batched", max_batch=4)
    twin = tmp_path / "twin"
    shutil.copytree(thinker, twin)
    spec = {k: v | {"draft_model": str(twin)} for k, v in jobs.items()}
    speculative = run_jobs(
        conn, redis_url, spec, "spec", max_batch=1, policy=SpeculationPolicy("always")
    )
    for key in jobs:
        thought, answer, count = parts(alone[key])
        assert thought and answer and "</think>" not in thought, (thought, answer)
        assert 0 < count < alone[key].response.usage.completion_tokens
        assert parts(batched[key]) == parts(speculative[key]) == (thought, answer, count)
    # max_tokens inside the reasoning: all of it is reasoning, and counted.
    short = run_jobs(
        conn, redis_url, {"s": body(thinker, PROMPTS[0], end_id, 0.0) | {"max_tokens": 3}}, "short"
    )
    thought, answer, count = parts(short["s"])
    assert thought and answer == "" and count == 3
    # A JSON answer after the reasoning: the grammar waits for </think>.
    fmt = {
        "response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": SCHEMA}}
    }
    shaped = run_jobs(
        conn, redis_url, {"f": body(thinker, PROMPTS[0], end_id) | fmt | {"max_tokens": 60}}, "json"
    )
    thought, answer, count = parts(shaped["f"])
    assert thought == parts(alone["j0"])[0]  # the same reasoning as unconstrained
    assert isinstance(json.loads(answer)["ok"], bool)
    # Streamed through the gateway: delta.reasoning_content and delta.content add up.
    gw = gateway()
    workers()
    req = body(thinker, PROMPTS[0], end_id)
    pieces = {"reasoning_content": "", "content": ""}
    for chunk in gw.client().chat.completions.create(
        model=req["model"],
        messages=req["messages"],
        temperature=0,
        max_tokens=40,
        logit_bias=req["logit_bias"],
        stream=True,
    ):
        for c in chunk.choices:
            extra = c.delta.model_extra or {}
            pieces["reasoning_content"] += extra.get("reasoning_content") or ""
            pieces["content"] += c.delta.content or ""
    thought, answer, _ = parts(alone["j0"])
    assert pieces == {"reasoning_content": thought, "content": answer}


def test_a_reasoning_model_thinks_then_makes_the_forced_call(conn, redis_url, tmp_path_factory):
    """Tools on a reasoning model: the thinking apart, then the call under the grammar
    (the mask waits for </think>), alone and batched."""
    import jsonschema

    from worker.dev.tinymodels import ensure_thinking_tool_model

    path = ensure_thinking_tool_model(tmp_path_factory.mktemp("think-tools") / "m")
    entry, _ = ModelCache().get(str(path))
    (end,) = entry.tokenizer.encode("</think>", add_special_tokens=False)
    tools = [{"type": "function", "function": {"name": "decide", "parameters": SCHEMA}}]
    jobs = {
        f"t{i}": body(path, p, end, bias=1.5)
        | {
            "tools": tools,
            "tool_choice": {"type": "function", "function": {"name": "decide"}},
            "max_tokens": 120,
        }
        for i, p in enumerate(PROMPTS)
    }
    alone = run_jobs(conn, redis_url, jobs, "think-tools-1", max_batch=1)
    batched = run_jobs(conn, redis_url, jobs, "think-tools-4", max_batch=4)
    thoughts = []
    for key in jobs:
        record = alone[key]
        assert record.status == "succeeded", record.error
        choice = record.response.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        # The call came after </think> (a mask from the first token would have made
        # the call at once, with no reasoning tokens at all).
        assert record.response.usage.completion_tokens_details.reasoning_tokens >= 1
        thoughts.append(choice.message.reasoning_content)
        assert "</think>" not in (choice.message.reasoning_content or "")
        (call,) = choice.message.tool_calls
        jsonschema.validate(json.loads(call.function.arguments), SCHEMA)
        other = batched[key].response.choices[0].message
        assert (other.reasoning_content, other.tool_calls[0].function.arguments) == (
            choice.message.reasoning_content,
            call.function.arguments,
        )
    assert any(thoughts)  # and some thought first
