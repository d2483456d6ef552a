"""The Responses API on the gateway, through the official SDK: a chat job plus a
translation, on a real gateway, Redis and worker process."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from schemas import keys
from schemas.responses import ResponsesRequest, TranslationError, input_messages, to_chat
from tests.test_gateway import gateway  # noqa: F401 (a fixture)
from tests.test_structured import SCHEMA
from tests.test_tools import TOOLS, WEATHER, tool_model  # noqa: F401 (a fixture)

SMALL = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 2, 3]}},
    "required": ["ok", "n"],
    "additionalProperties": False,
}


def _chat_text(client, model, messages, **fields) -> str:
    reply = client.chat.completions.create(
        model=model, messages=messages, temperature=0, max_tokens=12, **fields
    )
    return reply.choices[0].message.content


def test_responses_equal_chat_completions_stream_and_chain(gateway, workers, tiny, conn):  # noqa: F811
    gw = gateway()
    client = gw.client()
    workers()
    m = tiny.target
    r1 = client.responses.create(
        model=m, input="hello queue", instructions="be brief", temperature=0, max_output_tokens=12
    )
    assert r1.object == "response" and r1.id.startswith("resp_")
    want = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello queue"}]
    assert r1.output_text == _chat_text(client, m, want)
    assert r1.usage.output_tokens > 0 and r1.usage.total_tokens == (
        r1.usage.input_tokens + r1.usage.output_tokens
    )
    # streamed: the events add up to the response, which equals the plain one
    with client.responses.stream(
        model=m, input="hello queue", instructions="be brief", temperature=0, max_output_tokens=12
    ) as stream:
        kinds, deltas = [], []
        for event in stream:
            kinds.append(event.type)
            if event.type == "response.output_text.delta":
                deltas.append(event.delta)
        final = event.response  # completed, or incomplete (max_output_tokens: the SDK's
        # get_final_response waits for response.completed only)
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert "response.output_item.added" in kinds and "response.output_item.done" in kinds
    assert "".join(deltas) == final.output_text == r1.output_text
    # a chain of three carries its context: each equals the chat of the whole conversation
    r2 = client.responses.create(
        model=m, input="and then?", previous_response_id=r1.id, temperature=0, max_output_tokens=12
    )
    r3 = client.responses.create(
        model=m, input="why?", previous_response_id=r2.id, temperature=0, max_output_tokens=12
    )
    convo = [
        *want,
        {"role": "assistant", "content": r1.output_text},
        {"role": "user", "content": "and then?"},
        {"role": "assistant", "content": r2.output_text},
        {"role": "user", "content": "why?"},
    ]
    assert r3.output_text == _chat_text(client, m, convo)
    assert r1.usage.input_tokens < r2.usage.input_tokens < r3.usage.input_tokens
    assert client.responses.retrieve(r3.id).output_text == r3.output_text
    # store: false keeps nothing; a deleted response is gone
    gone = client.responses.create(model=m, input="x", store=False, max_output_tokens=2)
    assert not conn.exists(keys.response_key(gone.id))
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(gone.id)
    with pytest.raises(openai.NotFoundError, match="previous_response_id"):
        client.responses.create(model=m, input="x", previous_response_id=gone.id)
    client.responses.delete(r1.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r1.id)


def test_json_schema_and_tool_outputs_validate(gateway, workers, tiny, tool_model):  # noqa: F811
    gw = gateway()
    client = gw.client()
    workers()
    for schema in (SMALL, SCHEMA):  # SMALL closes within the limit; SCHEMA may not
        r = client.responses.create(
            model=tiny.target,
            input="describe it",
            temperature=0,
            max_output_tokens=160,
            text={"format": {"type": "json_schema", "name": "thing", "schema": schema}},
        )
        if schema is SMALL:
            assert r.status == "completed", r.output_text
        if r.status == "completed":
            jsonschema.validate(json.loads(r.output_text), schema)
    tools = [{"type": "function", **t["function"]} for t in TOOLS]
    r = client.responses.create(
        model=str(tool_model),
        input="weather in paris?",
        tools=tools,
        tool_choice={"type": "function", "name": "get_weather"},
        temperature=0,
        max_output_tokens=200,
    )
    calls = [item for item in r.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and calls[0].call_id
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER)
    # the call's output fed back continues the conversation: its prompt holds the call
    after = client.responses.create(
        model=str(tool_model),
        previous_response_id=r.id,
        input=[{"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny"}],
        tools=tools,  # tools are not carried over a chain (as OpenAI)
        temperature=0,
        max_output_tokens=8,
    )
    assert after.status in ("completed", "incomplete") and after.usage.input_tokens > (
        r.usage.input_tokens
    )


def test_hostile_and_unsupported_requests_are_refused_by_name(gateway):  # noqa: F811
    gw = gateway()
    client = gw.client()
    for fields, words in [
        ({"background": True}, "background"),
        ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input_image"),
        ({"input": [{"role": "user", "content": [{"type": "input_audio"}]}]}, "input_audio"),
        ({"input": [{"role": "robot", "content": "x"}]}, "role"),
        ({"input": [{"type": "web_search_call"}]}, "web_search_call"),
        ({"colour": "red"}, "colour"),
        ({"text": {"format": {"type": "json_schema", "schema": {}}}}, "needs a name"),
        ({"tool_choice": {"type": "file_search"}}, "tool_choice"),
    ]:
        body = {"model": "m", "input": "x"} | fields
        known = {k: v for k, v in body.items() if k != "colour"}
        extra = {k: v for k, v in body.items() if k == "colour"}
        with pytest.raises(openai.BadRequestError, match=words):
            client.responses.create(**known, extra_body=extra)


def test_the_translation_keeps_roles_calls_and_outputs_in_order():
    messages = input_messages(
        [
            {"role": "developer", "content": "rules"},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]},
            {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
            {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "one"},
            {"type": "reasoning", "summary": []},
        ]
    )
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool"]
    assert [c["id"] for c in messages[2]["tool_calls"]] == ["c1", "c2"]
    req = ResponsesRequest.model_validate({"model": "m", "input": "q", "instructions": "new"})
    body = to_chat(req, [{"role": "system", "content": "old"}, {"role": "user", "content": "p"}])
    assert body["messages"][0] == {"role": "system", "content": "new"}
    assert [m["content"] for m in body["messages"]] == ["new", "p", "q"]
    with pytest.raises(TranslationError):
        input_messages([])
