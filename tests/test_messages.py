"""Anthropic's Messages API on the gateway, driven by the official ``anthropic`` SDK.

Real pieces throughout: ``producer serve`` in a subprocess, real worker processes on
tiny models, a real redis-server. Each answer is checked against the same request sent
as a chat completion (greedy: the same job, so the same text).
"""

from __future__ import annotations

import json
from pathlib import Path

import anthropic
import jsonschema
import pytest
from click.testing import CliRunner

from producer.batches import batch_status, iter_output_lines
from producer.cli import main as cli
from schemas import keys
from schemas.anthropic import MessagesRequest, TranslationError, to_chat
from tests.test_gateway import KEY, gateway, request  # noqa: F401 (a fixture)
from tests.test_reasoning import thinker  # noqa: F401 (a fixture)
from tests.test_tools import TOOLS, WEATHER, tool_model  # noqa: F401 (a fixture)
from tests.waiting import wait_for

GREEDY = {"temperature": 0}  # (anthropic 2.x: sampling fields go in extra_body)


def client_of(gw, key: str = KEY) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=gw.url, api_key=key, max_retries=0)


def chat_text(gw, model: str, messages: list[dict], **fields) -> tuple[str, object]:
    reply = gw.client().chat.completions.create(
        model=model, messages=messages, temperature=0, **fields
    )
    return reply.choices[0].message.content, reply


def test_a_message_equals_its_chat_completion_plain_and_streamed(gateway, workers, tiny):  # noqa: F811
    gw = gateway()
    workers()
    client = client_of(gw)
    m = tiny.target
    ask = {"role": "user", "content": [{"type": "text", "text": "hello queue"}]}
    msg = client.messages.create(
        model=m, max_tokens=12, system="be brief", messages=[ask], extra_body=GREEDY
    )
    want = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello queue"}]
    text, chat = chat_text(gw, m, want, max_tokens=12)
    assert msg.type == "message" and msg.role == "assistant" and msg.id.startswith("msg_")
    assert [b.type for b in msg.content] == ["text"] and msg.content[0].text == text
    assert msg.stop_reason == (
        "max_tokens" if chat.choices[0].finish_reason == "length" else "end_turn"
    )
    assert msg.usage.output_tokens == chat.usage.completion_tokens
    prompt = msg.usage.input_tokens + (msg.usage.cache_read_input_tokens or 0)
    assert prompt == chat.usage.prompt_tokens
    # streamed: Anthropic's events, in order, adding up to the same message
    with client.messages.stream(
        model=m, max_tokens=12, system="be brief", messages=[ask], extra_body=GREEDY
    ) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert kinds[-2] == "message_delta" and "content_block_start" in kinds
    assert kinds.index("content_block_stop") > kinds.index("content_block_delta")
    assert final.content[0].text == text and final.stop_reason == msg.stop_reason
    assert final.usage.output_tokens == msg.usage.output_tokens
    # speculative (a draft model, mlxq's field): the same text
    drafted = client.messages.create(
        model=m,
        max_tokens=12,
        system="be brief",
        messages=[ask],
        extra_body=GREEDY | {"draft_model": tiny.draft},
    )
    assert drafted.content[0].text == text
    # a stop sequence met ends the text before it, and is named
    k = next(i for i in range(1, len(text) - 3) if text.find(text[i : i + 3]) == i)
    cut = client.messages.create(
        model=m,
        max_tokens=12,
        system="be brief",
        messages=[ask],
        stop_sequences=["\x00never", text[k : k + 3]],
        extra_body=GREEDY,
    )
    assert cut.content[0].text == text[:k]
    assert (cut.stop_reason, cut.stop_sequence) == ("stop_sequence", text[k : k + 3])
    # count_tokens: the prompt as the model's template and tokenizer count it
    counted = client.messages.count_tokens(model=m, system="be brief", messages=[ask])
    assert counted.input_tokens == chat.usage.prompt_tokens
    # a model no worker has: a worker's 404, in Anthropic's shape, plain and streamed
    missing = str(Path(m).parent / "no-such-model")
    for stream in (False, True):
        with pytest.raises(anthropic.NotFoundError) as e:
            out = client.messages.create(model=missing, max_tokens=2, messages=[ask], stream=stream)
            list(out) if stream else out
        assert e.value.body["error"]["type"] == "not_found_error", e.value.body


def test_tool_use_plain_streamed_and_its_result_fed_back(gateway, workers, tool_model):  # noqa: F811
    gw = gateway()
    workers()
    client = client_of(gw)
    tools = [
        {
            "name": t["function"]["name"],
            "description": t["function"].get("description", ""),
            "input_schema": t["function"]["parameters"],
        }
        for t in TOOLS
    ]
    ask = [{"role": "user", "content": "weather in paris?"}]
    forced = {"type": "tool", "name": "get_weather"}
    fields = {"model": str(tool_model), "max_tokens": 200, "tools": tools, "tool_choice": forced}
    msg = client.messages.create(messages=ask, extra_body=GREEDY, **fields)
    uses = [b for b in msg.content if b.type == "tool_use"]
    assert msg.stop_reason == "tool_use" and len(uses) == 1 and uses[0].name == "get_weather"
    jsonschema.validate(uses[0].input, WEATHER)
    with client.messages.stream(messages=ask, extra_body=GREEDY, **fields) as stream:
        partial = "".join(
            e.delta.partial_json
            for e in stream
            if e.type == "content_block_delta" and e.delta.type == "input_json_delta"
        )
        final = stream.get_final_message()
    streamed = [b for b in final.content if b.type == "tool_use"]
    assert json.loads(partial) == streamed[0].input == uses[0].input
    assert final.stop_reason == "tool_use"
    # the round trip: the call and its result become the chat's tool call and tool message
    after = client.messages.create(
        model=str(tool_model),
        max_tokens=8,
        tools=tools,
        messages=[
            *ask,
            {"role": "assistant", "content": msg.content},
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": uses[0].id, "content": "sunny"}],
            },
        ],
        extra_body=GREEDY,
    )
    assert after.stop_reason in ("end_turn", "max_tokens", "tool_use")
    assert after.usage.input_tokens + (after.usage.cache_read_input_tokens or 0) > (
        msg.usage.input_tokens + (msg.usage.cache_read_input_tokens or 0)
    )


def test_thinking_comes_back_as_thinking_blocks(gateway, workers, thinker):  # noqa: F811
    gw = gateway()
    workers()
    client = client_of(gw)
    ask = [{"role": "user", "content": "think about the queue"}]
    fields = {"model": str(thinker), "max_tokens": 24, "messages": ask, "extra_body": GREEDY}
    on = {"type": "enabled", "budget_tokens": 1024}
    msg = client.messages.create(thinking=on, **fields)
    chat = gw.client().chat.completions.create(
        model=str(thinker), messages=ask, max_tokens=24, temperature=0
    )
    thought = chat.choices[0].message.reasoning_content
    assert thought and msg.content[0].type == "thinking"
    assert msg.content[0].thinking == thought
    with client.messages.stream(thinking=on, **fields) as stream:
        deltas = [e.delta for e in stream if e.type == "content_block_delta"]
        final = stream.get_final_message()
    assert "".join(d.thinking for d in deltas if d.type == "thinking_delta") == thought
    assert [b.type for b in final.content] == [b.type for b in msg.content]


def test_an_image_block_is_the_chat_jobs_image(gateway, workers, tmp_path):  # noqa: F811
    pytest.importorskip("mlx_vlm")
    from worker.dev.tinyvlm import ensure_vlm

    from .test_vision import data_url, png

    vlm = str(ensure_vlm(tmp_path / "tiny-gemma3-vlm"))
    gw = gateway()
    workers()
    url = data_url(png(1))
    chat_parts = [
        {"type": "image_url", "image_url": {"url": url}},
        {"type": "text", "text": "describe the queue"},
    ]
    text, _ = chat_text(gw, vlm, [{"role": "user", "content": chat_parts}], max_tokens=8)
    media, data = url[len("data:") :].split(";base64,")
    blocks = [
        {"type": "image", "source": {"type": "base64", "media_type": media, "data": data}},
        {"type": "text", "text": "describe the queue"},
    ]
    msg = client_of(gw).messages.create(
        model=vlm, max_tokens=8, messages=[{"role": "user", "content": blocks}], extra_body=GREEDY
    )
    assert msg.content[0].text == text
    broken = [{"type": "image", "source": {"type": "base64", "media_type": media, "data": "AAAA"}}]
    with pytest.raises(anthropic.BadRequestError) as e:
        client_of(gw).messages.create(
            model=vlm, max_tokens=8, messages=[{"role": "user", "content": broken}]
        )
    assert e.value.body["type"] == "error" and "image" in e.value.body["error"]["message"]


def test_errors_have_anthropics_shape_and_name_what_is_wrong(gateway, tiny):  # noqa: F811
    gw = gateway("--allow-model", str(Path(tiny.target).parent) + "/*")  # (no worker runs)
    client = client_of(gw)
    ok = {"model": tiny.target, "max_tokens": 4, "messages": [{"role": "user", "content": "x"}]}
    with pytest.raises(anthropic.AuthenticationError) as e:
        client_of(gw, key="wrong").messages.create(**ok)
    assert e.value.body == {
        "type": "error",
        "error": {"type": "authentication_error", "message": "missing or invalid API key"},
    }
    for fields, words in [
        ({"mcp_servers": [{"type": "url", "url": "https://x", "name": "x"}]}, "mcp_servers"),
        ({"container": "c"}, "container"),
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "server tools"),
        ({"tool_choice": {"type": "any"}}, "needs tools"),
        ({"messages": [{"role": "system", "content": "x"}]}, "messages.0.role"),
        ({"messages": [{"role": "user", "content": [{"type": "document"}]}]}, "document"),
        ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "source"),
        ({"stop_sequences": ["a", "b", "c", "d", "e"]}, "stop_sequences"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"colour": "red"}, "colour"),
    ]:
        with pytest.raises(anthropic.BadRequestError, match=words) as e:
            client.messages.create(**ok, extra_body=fields)  # (over the SDK's own fields)
        assert e.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.NotFoundError) as e:
        client.messages.create(**(ok | {"model": "elsewhere/model"}))
    assert e.value.body["error"]["type"] == "not_found_error"
    bad = request("POST", f"{gw.url}/v1/messages", b"{not json", {"x-api-key": KEY})
    assert bad.status == 400 and bad.json()["type"] == "error"


def test_the_translation_keeps_roles_calls_and_results_in_order():
    req = MessagesRequest.model_validate(
        {
            "model": "m",
            "max_tokens": 5,
            "system": [{"type": "text", "text": "rules"}],
            "metadata": {"user_id": "u1"},
            "stop_sequences": ["END"],
            "tools": [{"name": "f", "input_schema": {"type": "object"}}],
            "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
            "messages": [
                {"role": "user", "content": "hi"},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "thinking", "thinking": "hmm", "signature": "s"},
                        {"type": "text", "text": "calling"},
                        {"type": "tool_use", "id": "t1", "name": "f", "input": {"a": 1}},
                    ],
                },
                {
                    "role": "user",
                    "content": [
                        {"type": "tool_result", "tool_use_id": "t1", "content": "one"},
                        {
                            "type": "tool_result",
                            "tool_use_id": "t2",
                            "is_error": True,
                            "content": [{"type": "text", "text": "bad"}],
                        },
                        {"type": "text", "text": "and?"},
                    ],
                },
            ],
        }
    )
    body = to_chat(req)
    assert body["messages"] == [
        {"role": "system", "content": "rules"},
        {"role": "user", "content": "hi"},
        {
            "role": "assistant",
            "content": "calling",
            "tool_calls": [
                {"id": "t1", "type": "function", "function": {"name": "f", "arguments": '{"a":1}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "t1", "content": "one"},
        {"role": "tool", "tool_call_id": "t2", "content": "Error: bad"},
        {"role": "user", "content": "and?"},
    ]
    assert body["stop"] == ["END"] and body["user"] == "u1" and body["max_tokens"] == 5
    assert body["tool_choice"] == "required" and body["parallel_tool_calls"] is False
    image = {
        "role": "user",
        "content": [
            {
                "type": "tool_result",
                "tool_use_id": "t",
                "content": [{"type": "image", "source": {"type": "url", "url": "https://x"}}],
            }
        ],
    }
    with pytest.raises(TranslationError, match=r"messages\.0\.content\.0\.content\.0"):
        to_chat(req.model_copy(update={"messages": [image]}))
    for hostile in ({"a": 1}, 7, [1, 2]):  # a tool result's content of no allowed shape
        result = {"type": "tool_result", "tool_use_id": "t", "content": hostile}
        bad = {"role": "user", "content": [result]}
        with pytest.raises(TranslationError, match=r"messages\.0\.content\.0\.content"):
            to_chat(req.model_copy(update={"messages": [bad]}))


def _ask(model: str, text: str, **params) -> dict:
    return {"model": model, "max_tokens": 8, "messages": [{"role": "user", "content": text}]} | (
        GREEDY | params
    )


def test_a_message_batch_ends_with_the_results_of_its_requests_sent_alone(
    gateway,  # noqa: F811
    workers,
    tiny,
    conn,
    tmp_path,
    redis_url,
):
    gw = gateway(api_keys=f"{KEY}=team-a,sk-other=team-b")
    workers()
    client = client_of(gw)
    asks = {f"r{i}": _ask(tiny.target, f"question {i}") for i in range(4)}
    asks["r4"] = _ask(tiny.target, "question 4", stop_sequences=["\x00"])
    made = client.messages.batches.create(
        requests=[{"custom_id": cid, "params": p} for cid, p in asks.items()]
    )
    assert made.type == "message_batch" and made.processing_status == "in_progress"
    assert made.request_counts.processing + made.request_counts.succeeded == 5
    ended = wait_for(
        lambda: (b := client.messages.batches.retrieve(made.id)).processing_status == "ended" and b,
        timeout=120,
        every=0.3,
    )
    assert ended.request_counts.succeeded == 5 and ended.ended_at is not None
    assert ended.results_url.endswith(f"/v1/messages/batches/{made.id}/results")
    results = {r.custom_id: r.result for r in client.messages.batches.results(made.id)}
    assert sorted(results) == sorted(asks)
    for cid, params in asks.items():
        alone = client.messages.create(
            model=params["model"],
            max_tokens=8,
            messages=params["messages"],
            extra_body={
                k: v for k, v in params.items() if k not in ("model", "messages", "max_tokens")
            },
        )
        assert results[cid].type == "succeeded"
        assert results[cid].message.content[0].text == alone.content[0].text, cid
        assert results[cid].message.stop_reason == alone.stop_reason
    # the batch is an mlxq batch: producer status reads it, its tenant's key only sees it
    assert int(conn.hget(keys.batch_key(made.id), "succeeded")) == 5
    assert [b.id for b in client.messages.batches.list()] == [made.id]
    assert list(client_of(gw, "sk-other").messages.batches.list()) == []
    with pytest.raises(anthropic.NotFoundError):
        client_of(gw, "sk-other").messages.batches.retrieve(made.id)
    # producer submit takes the same requests as lines (custom_id, params); its output
    # lines carry the messages
    path = tmp_path / "anthropic.jsonl"
    lines = [json.dumps({"custom_id": c, "params": p}) + "\n" for c, p in asks.items()]
    path.write_text("".join(lines))
    args = ["submit", str(path), "--batch-id", "from-file", "--redis-url", redis_url]
    submitted = CliRunner().invoke(cli, args)
    assert submitted.exit_code == 0, submitted.output
    wait_for(lambda: batch_status(conn, "from-file").finished, timeout=120, every=0.3)
    out = {line.custom_id: line.response.body for line in iter_output_lines(conn, "from-file")}
    for cid, result in results.items():
        assert out[cid]["type"] == "message"
        assert out[cid]["content"][0]["text"] == result.message.content[0].text
    assert client.messages.batches.delete(made.id).type == "message_batch_deleted"
    with pytest.raises(anthropic.NotFoundError):
        client.messages.batches.retrieve(made.id)


def test_a_bad_request_refuses_the_whole_batch_naming_it(gateway, tiny, conn):  # noqa: F811
    gw = gateway()
    client = client_of(gw)
    before = conn.zcard(keys.BATCHES)
    for requests, words in [
        ([{"custom_id": "a", "params": _ask(tiny.target, "x")}] * 2, "custom_id"),
        ([{"custom_id": "a", "params": _ask(tiny.target, "x", stream=True)}], "stream"),
        ([{"custom_id": "a b", "params": _ask(tiny.target, "x")}], r"requests\.0\.custom_id"),
        (
            [
                {"custom_id": "ok", "params": _ask(tiny.target, "x")},
                {"custom_id": "bad", "params": _ask(tiny.target, "x", max_tokens=0)},
            ],
            r"requests\.1\.params\.max_tokens",
        ),
        ([], "requests"),
    ]:
        with pytest.raises(anthropic.BadRequestError, match=words) as e:
            client.messages.batches.create(requests=requests)
        assert e.value.body["type"] == "error"
    assert conn.zcard(keys.BATCHES) == before  # nothing enqueued


def test_cancel_mid_batch_stops_the_running_request_and_the_rest(gateway, workers, tiny, conn):  # noqa: F811
    gw = gateway()
    client = client_of(gw)
    slow = {"model": tiny.slow, "max_tokens": 1500, "temperature": 0}
    made = client.messages.batches.create(
        requests=[
            {
                "custom_id": f"s{i}",
                "params": slow | {"messages": [{"role": "user", "content": f"slow {i}"}]},
            }
            for i in range(5)
        ]
    )
    workers("--max-batch", "1", "--queue", "mlxq")
    wait_for(lambda: conn.hlen(keys.RUNNING) == 1, timeout=60)
    assert client.messages.batches.cancel(made.id).processing_status in ("canceling", "ended")
    ended = wait_for(
        lambda: (b := client.messages.batches.retrieve(made.id)).processing_status == "ended" and b,
        timeout=120,
        every=0.3,
    )
    counts = ended.request_counts
    assert counts.processing == 0 and counts.canceled >= 4  # (the first may have ended)
    assert counts.succeeded + counts.errored + counts.canceled == 5
    results = list(client.messages.batches.results(made.id))
    kinds = sorted(r.result.type for r in results)
    assert len(results) == 5 and kinds.count("canceled") == counts.canceled


def test_requests_not_run_in_the_window_expire(gateway, tiny, conn):  # noqa: F811
    gw = gateway()
    client = client_of(gw)
    made = client.messages.batches.create(
        requests=[{"custom_id": f"e{i}", "params": _ask(tiny.target, "x")} for i in range(3)]
    )
    day_ago = float(conn.hget(keys.batch_key(made.id), "created_at")) - 24 * 3600 - 1
    conn.hset(keys.batch_key(made.id), "created_at", day_ago)  # (no worker ran them)
    ended = client.messages.batches.retrieve(made.id)
    assert ended.processing_status == "ended"
    assert (ended.request_counts.expired, ended.request_counts.canceled) == (3, 0)
    assert [r.result.type for r in client.messages.batches.results(made.id)] == ["expired"] * 3


def test_message_batches_list_newest_first_in_pages(gateway, tiny, conn):  # noqa: F811
    from producer import Client

    gw = gateway()
    client = client_of(gw)
    made = [
        client.messages.batches.create(
            requests=[{"custom_id": "a", "params": _ask(tiny.target, f"x {i}")}]
        ).id
        for i in range(3)
    ]
    Client(connection=conn).submit([_ask(tiny.target, "not a message batch")], batch_id="other")
    page = client.messages.batches.list(limit=2)
    assert [b.id for b in page.data] == made[:0:-1] and page.has_more
    rest = client.messages.batches.list(limit=2, after_id=made[1])
    assert [b.id for b in rest.data] == [made[0]] and not rest.has_more
    back = client.messages.batches.list(limit=2, before_id=made[0])
    assert [b.id for b in back.data] == made[:0:-1]


def test_bad_message_batch_lines_are_refused_by_line_and_name():
    from producer.lines import LineInvalid, parse_line

    ok = {"custom_id": "a", "params": _ask("m", "x")}
    custom_id, request, body, shape = parse_line(json.dumps(ok), 1)
    assert custom_id == "a" and shape == {"url": "/v1/messages", "model": "m"}
    assert body["messages"] == [{"role": "user", "content": "x"}] and request.max_tokens == 8
    for line, words in [
        (ok | {"custom_id": 7}, "custom_id"),
        (ok | {"params": "x"}, "params: must be an object"),
        (ok | {"params": _ask("m", "x", stream=True)}, "stream"),
        (ok | {"params": _ask("m", "x", max_tokens=0)}, "params.max_tokens"),
        (ok | {"params": _ask("m", "x", container="c")}, "container"),
    ]:
        with pytest.raises(LineInvalid, match=words):
            parse_line(json.dumps(line), 1)
