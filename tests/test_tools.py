"""Tool calls: requests checked by name, tools rendered by the model's own template,
calls parsed with mlx-lm's parser, and forced calls whose arguments always validate.

A tiny model with a Hermes / Qwen-style template (``worker.dev.tinymodels``) and a
byte-level tokenizer, through the real ``mlx_lm.load``, a real Redis and a real
worker; random weights, so a valid call comes from the grammar, not the model.
"""

from __future__ import annotations

import json
import shutil

import jsonschema
import pytest
from pydantic import ValidationError

from schemas import ChatRequest
from tests.conftest import chat, run_jobs
from tests.test_gateway import gateway  # noqa: F401 (a fixture)
from worker.dev.tinymodels import ensure_tool_model
from worker.engine import toolcalls
from worker.engine.models import ModelCache
from worker.engine.request import prompt_tokens
from worker.schedule.policy import SpeculationPolicy

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "when": {
            "type": "object",
            "properties": {"day": {"type": "integer", "minimum": 0, "maximum": 6}},
            "required": ["day"],
            "additionalProperties": False,
        },
    },
    "required": ["city", "unit", "when"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"zone": {"enum": ["utc", "cet"]}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
NAMED = {"type": "function", "function": {"name": "get_weather"}}
#: A conversation with a call made and its result.
HISTORY = [
    {"role": "user", "content": "weather in paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_time", "arguments": '{"zone": "cet"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "noon"},
]


@pytest.fixture(scope="module")
def tool_model(tmp_path_factory):
    return ensure_tool_model(tmp_path_factory.mktemp("tools") / "hermes")


@pytest.fixture(scope="module")
def tool_twin(tool_model, tmp_path_factory):
    twin = tmp_path_factory.mktemp("tools-twin") / "twin"
    shutil.copytree(tool_model, twin)
    return twin


def body(model, content="weather in paris?", choice=NAMED, **fields) -> dict:
    return chat(
        str(model),
        content=content,
        tools=TOOLS,
        tool_choice=choice,
        temperature=0,
        max_tokens=400,
        **fields,
    )


def calls_of(record) -> list[list[tuple[str, dict]]]:
    """Each choice's calls as (name, arguments), after checking the OpenAI shape and
    that every call's arguments validate against its function's schema."""
    assert record.status == "succeeded", record.error
    out = []
    for choice in record.response.choices:
        msg = choice.message
        assert choice.finish_reason == "tool_calls" and msg.tool_calls, choice
        assert msg.content is None
        got = []
        for call in msg.tool_calls:
            assert call.type == "function" and call.id.startswith("call_")
            args = json.loads(call.function.arguments)
            jsonschema.validate(args, SCHEMAS[call.function.name])
            got.append((call.function.name, args))
        out.append(got)
    return out


# -- requests ---------------------------------------------------------------
@pytest.mark.parametrize(
    ("change", "word"),
    [
        ({"tools": [{"type": "function", "function": {"parameters": TIME}}]}, "name"),
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "name"),
        ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "type"),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {"name": "f", "parameters": {"type": "string"}},
                    }
                ]
            },
            "JSON schema of an object",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": [1]}}]},
            "parameters",
        ),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {
                            "name": "f",
                            "parameters": {"type": "object", "properties": {"a": {"not": {}}}},
                        },
                    }
                ]
            },
            "cannot be enforced",
        ),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {
                            "name": "f",
                            "parameters": {
                                "type": "object",
                                "description": "x" * 70_000,
                            },
                        },
                    }
                ]
            },
            "bytes",
        ),
        (
            {"tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "not among the tools",
        ),
        ({"tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": TOOLS + TOOLS[:1]}, "unique"),
        ({"tools": None, "tool_choice": "required"}, "no tools"),
        ({"stop": ["x"]}, "stop"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"functions": [{"name": "f"}]}, "legacy"),
        ({"function_call": {"name": "f"}}, "legacy"),
        (
            {"messages": [{"role": "tool", "content": "sunny"}]},
            "tool_call_id",
        ),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": "x",
                        "tool_calls": [
                            {
                                "id": "c",
                                "type": "function",
                                "function": {"name": "f", "arguments": "{}"},
                            }
                        ],
                    }
                ]
            },
            "only assistant",
        ),
        ({"messages": [{"role": "user", "content": None}]}, "needs content"),
    ],
)
def test_hostile_tool_requests_are_refused_by_name(change, word):
    request = body("some/model") | change
    with pytest.raises(ValidationError, match=word):
        ChatRequest.model_validate(request)


def test_the_template_renders_tools_and_a_history_with_tool_results(tool_model):
    entry, _ = ModelCache().get(str(tool_model))
    history = HISTORY
    req = ChatRequest.model_validate(body(tool_model) | {"messages": history})
    # An assistant turn that only calls may leave content out, as OpenAI's API allows.
    bare = [m if m["role"] != "assistant" else {k: v for k, v in m.items() if k != "content"}
            for m in history]  # fmt: skip
    assert ChatRequest.model_validate(body(tool_model) | {"messages": bare}) == req
    text = entry.tokenizer.decode(prompt_tokens(entry.tokenizer, req))
    assert '"name": "get_weather"' in text and '"maxLength": 12' in text  # the tools
    assert '<tool_call>\n{"name": "get_time", "arguments": {"zone": "cet"}}' in text
    assert "<tool_response>\nnoon\n</tool_response>" in text
    none = ChatRequest.model_validate(body(tool_model, choice="none"))
    assert "get_weather" not in entry.tokenizer.decode(prompt_tokens(entry.tokenizer, none))


def test_calls_are_parsed_with_the_models_parser_and_nothing_is_dropped(tool_model):
    entry, _ = ModelCache().get(str(tool_model))
    family = toolcalls.family_of(entry.tokenizer)
    assert family is not None and family.name == "json_tools"
    one = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "utc"}}\n</tool_call>'
    content, calls = toolcalls.parse(f"{one}\n{one}", family, TOOLS)
    assert content is None and [c.function.name for c in calls] == ["get_time"] * 2
    assert json.loads(calls[0].function.arguments) == {"zone": "utc"}
    content, calls = toolcalls.parse(f"Let me check. {one}", family, TOOLS)
    assert content == "Let me check. " and len(calls) == 1
    cut = '<tool_call>\n{"name": "get_time", "argu'
    assert toolcalls.parse(cut, family, TOOLS) == (cut, [])  # cut short: kept as text
    broken = "<tool_call>\nnot json\n</tool_call>"
    assert toolcalls.parse(broken, family, TOOLS) == (broken, [])


def test_a_model_without_tool_calling_is_refused_naming_it(conn, redis_url, tiny):
    records = run_jobs(conn, redis_url, {"t": body(tiny.target)}, "no-tools")
    record = records["t"]
    assert record.status == "failed" and record.error.code == "invalid_request"
    assert "does not support tool calling" in record.error.message
    assert str(tiny.target) in record.error.message


# -- forced calls on every path -----------------------------------------------------
def test_forced_calls_validate_and_agree_on_every_path(conn, redis_url, tool_model, tool_twin):
    prompts = ["weather in paris?", "and in rome", "time please", "weather tomorrow"]
    named = {f"n{i}": body(tool_model, p) for i, p in enumerate(prompts)}
    required = {f"r{i}": body(tool_model, p, choice="required") for i, p in enumerate(prompts)}
    single = {f"s{i}": body(tool_model, p, choice="required", parallel_tool_calls=False)
              for i, p in enumerate(prompts)}  # fmt: skip
    jobs = named | required | single
    alone = run_jobs(conn, redis_url, jobs, "alone", max_batch=1)
    batched = run_jobs(conn, redis_url, jobs, "batched", max_batch=4)
    spec = {k: v | {"draft_model": str(tool_twin)} for k, v in jobs.items()}
    speculative = run_jobs(
        conn, redis_url, spec, "spec", max_batch=1, policy=SpeculationPolicy("always")
    )
    spec_batched = run_jobs(
        conn, redis_url, spec, "spec-b", max_batch=4, policy=SpeculationPolicy("always")
    )
    for key in jobs:
        calls = calls_of(alone[key])
        if key.startswith("n"):
            assert [name for name, _ in calls[0]] == ["get_weather"]
        if key.startswith("s"):
            assert len(calls[0]) == 1
        for other in (batched, speculative, spec_batched):
            assert calls_of(other[key]) == calls, key
    assert speculative["n0"].metrics.speculative
    assert speculative["n0"].metrics.draft_tokens_accepted > 0
    # auto: free text, unless the model opens a call (pushed here by a bias on the
    # marker token): from there the grammar holds, so the call validates too.
    entry, _ = ModelCache().get(str(tool_model))
    (marker,) = entry.tokenizer.encode("<tool_call>", add_special_tokens=False)
    pushed = {
        f"a{i}": body(tool_model, p, choice="auto", parallel_tool_calls=False)
        | {"logit_bias": {str(marker): 100}}
        for i, p in enumerate(prompts)
    }
    free = {"free": body(tool_model, choice="auto") | {"max_tokens": 24}}
    for path, (batch, kw) in {
        "alone": ("auto-1", {"max_batch": 1}),
        "batched": ("auto-4", {"max_batch": 4}),
        "speculative": ("auto-s", {"max_batch": 4, "policy": SpeculationPolicy("always")}),
    }.items():
        extra = {"draft_model": str(tool_twin)} if path == "speculative" else {}
        got = run_jobs(
            conn, redis_url, {k: v | extra for k, v in (pushed | free).items()}, batch, **kw
        )
        auto_calls = {k: calls_of(got[k]) for k in pushed}
        assert all(len(c[0]) == 1 for c in auto_calls.values()), path
        if path == "alone":
            first = auto_calls
        assert auto_calls == first, path
        text = got["free"].response.choices[0]
        assert text.message.tool_calls is None and text.message.content, path
    # n choices: each choice is a valid call; sampled, so they may differ.
    n = run_jobs(
        conn,
        redis_url,
        {"n": body(tool_model, n=3) | {"temperature": 1.0}},
        "n-choices",
    )
    assert len(calls_of(n["n"])) == 3


# -- the gateway (the official SDK) and Batch API files -------------------------------
def test_the_sdk_gets_validated_calls_through_the_gateway_and_batch_files(
    gateway,  # noqa: F811 (the fixture imported above)
    workers,
    tool_model,
    tmp_path,
    redis_url,
):
    from click.testing import CliRunner

    from producer.cli import main as producer_main
    from tests.conftest import write_jsonl

    gw = gateway()
    workers()
    client = gw.client()
    history = HISTORY
    named = {
        "model": str(tool_model),
        "messages": history,
        "tools": TOOLS,
        "tool_choice": NAMED,
        "temperature": 0,
        "max_tokens": 400,
    }
    reply = client.chat.completions.create(**named)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    # Streamed: the SDK's stream helper reassembles delta.tool_calls into the same call.
    with client.chat.completions.stream(**named) as stream:
        deltas = [e for e in stream if e.type == "tool_calls.function.arguments.delta"]
        final = stream.get_final_completion()
    streamed = final.choices[0]
    assert len(deltas) > 1 and streamed.finish_reason == "tool_calls"  # in fragments
    assert not streamed.message.content
    (same,) = streamed.message.tool_calls
    assert (same.function.name, same.function.arguments) == (
        call.function.name,
        call.function.arguments,
    )
    # Free text under auto streams as content, equal to the answer unstreamed.
    kw = {"model": str(tool_model), "tools": TOOLS, "tool_choice": "auto", "temperature": 0}
    plain = client.chat.completions.create(messages=history[:1], max_tokens=24, **kw)
    pieces = [
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(
            messages=history[:1], max_tokens=24, stream=True, **kw
        )
        if c.choices
    ]
    assert plain.choices[0].message.tool_calls is None
    assert "".join(pieces) == plain.choices[0].message.content
    # A Batch API file: the same call in its output line.
    line = {
        "custom_id": "w1",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": body(tool_model) | {"messages": history},
    }
    jobs = write_jsonl(tmp_path / "tools.jsonl", [line])
    sub = CliRunner().invoke(producer_main, ["submit", str(jobs), "--redis-url", redis_url])
    assert sub.exit_code == 0, sub.output
    out = CliRunner().invoke(
        producer_main, ["results", sub.stdout.strip(), "--wait", "--redis-url", redis_url]
    )
    got = json.loads(out.stdout.strip().splitlines()[0])
    message = got["response"]["body"]["choices"][0]["message"]
    assert message["tool_calls"][0]["function"] == {
        "name": call.function.name,
        "arguments": call.function.arguments,
    }


def test_streamed_text_is_held_from_the_call_marker_on(tool_model):
    """Content streams until the marker (a piece that could begin it waits); the call
    goes out as delta.tool_calls; held text that turned out to be no call is sent at
    the end, so the streamed content always equals the final one."""
    from schemas import ResultRecord
    from schemas.result import AssistantMessage, ChatCompletion, Choice, Usage
    from worker.runner.streamer import Streamer

    class Chunks:
        def __init__(self) -> None:
            self.sent: list[tuple[str, object]] = []

        def text(self, delta: str, logprobs: object = None, field: str = "content") -> None:
            self.sent.append(("text", delta))

        def tool_call(self, index: int, call: dict) -> None:
            if "id" in call:
                assert call["id"] == toolcalls.call_id("c", 0, index) and call["type"] == "function"
                self.sent.append(("call", index, call["function"]["name"]))
            else:
                self.sent.append(("args", index, call["function"]["arguments"]))

        def finish(self, reason: str, usage: dict) -> None:
            self.sent.append(("finish", reason))

    entry, _ = ModelCache().get(str(tool_model))
    family = toolcalls.family_of(entry.tokenizer)
    one = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "utc"}}\n</tool_call>'

    def stream(pieces: list[str]) -> list[tuple[str, object]]:
        chunks = Chunks()
        chunks.base = {"id": "c"}
        s = Streamer(chunks, entry, False, family)  # type: ignore[arg-type]
        for piece in pieces:
            s(piece, ())
        ids = lambda n: toolcalls.call_id("c", 0, n)  # noqa: E731
        content, calls = toolcalls.parse("".join(pieces), family, TOOLS, ids)
        message = AssistantMessage(content=content, tool_calls=calls or None)
        reason = "tool_calls" if calls else "stop"
        response = ChatCompletion(
            id="c",
            created=0,
            model="m",
            choices=[Choice(message=message, finish_reason=reason)],
            usage=Usage(prompt_tokens=1, completion_tokens=1, total_tokens=2),
        )
        record = {"job_id": "j", "batch_id": "b", "custom_id": "c", "finished_at": 0.0}
        s.end(ResultRecord(**record, status="succeeded", response=response))
        return chunks.sent

    assert stream(["Let me ", "check <to", "ol_call>", one[len("<tool_call>") :]]) == [
        ("text", "Let me "),
        ("text", "check "),
        ("call", 0, "get_time"),
        ("args", 0, '{"zone": "utc"}'),
        ("finish", "tool_calls"),
    ]
    # Arguments go out in fragments as they are written; a trailing "}" waits until it
    # is known to be theirs, so the fragments add up to the record's arguments.
    pieces = [
        '<tool_call>\n{"name": "get_time", "arguments": {"zo',
        'ne": "u',
        'tc"}',
        "}\n</tool_call>",
        one,
    ]
    assert stream(pieces) == [
        ("call", 0, "get_time"),
        ("args", 0, '{"zo'),
        ("args", 0, 'ne": "u'),
        ("args", 0, 'tc"}'),
        ("call", 1, "get_time"),
        ("args", 1, '{"zone": "utc"}'),
        ("finish", "tool_calls"),
    ]
    assert stream(["a <to", "y> b"]) == [
        ("text", "a "),
        ("text", "<toy> b"),
        ("finish", "stop"),
    ]
    cut = ["ok ", '<tool_call>\n{"name": "get_t']  # no call: the held text comes at the end
    assert stream(cut) == [("text", "ok "), ("text", cut[1]), ("finish", "stop")]


def test_another_family_is_parsed_under_auto_and_refused_when_forced(
    conn, redis_url, tmp_path_factory
):
    """mlx-lm's pythonic family (LFM2's ``[name(arg=value)]`` calls): rendered and parsed
    with mlx-lm's own parser; a call it cannot constrain yet is refused by name."""
    from worker.dev.tinymodels import ensure_pythonic_model

    path = ensure_pythonic_model(tmp_path_factory.mktemp("pythonic") / "lfm")
    entry, _ = ModelCache().get(str(path))
    family = toolcalls.family_of(entry.tokenizer)
    assert family is not None and family.name == "pythonic"
    text = '<|tool_call_start|>[get_time(zone="utc"), get_weather(city="Rome")]<|tool_call_end|>'
    content, calls = toolcalls.parse(text, family, TOOLS)
    assert content is None
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("get_time", {"zone": "utc"}),
        ("get_weather", {"city": "Rome"}),
    ]
    prompt = entry.tokenizer.decode(
        prompt_tokens(entry.tokenizer, ChatRequest.model_validate(body(path, choice="auto")))
    )
    assert "<|tool_list_start|>" in prompt and '"get_weather"' in prompt
    strict = [{"type": "function", "function": TOOLS[1]["function"] | {"strict": True}}]
    records = run_jobs(
        conn,
        redis_url,
        {
            "auto": body(path, choice="auto") | {"max_tokens": 8},
            "forced": body(path),
            "strict": body(path, choice="auto") | {"tools": strict},
        },
        "pythonic",
    )
    assert (
        records["auto"].status == "succeeded"
        and records["auto"].response.choices[0].message.content
    )
    for key in ("forced", "strict"):
        error = records[key].error
        assert records[key].status == "failed" and error.code == "invalid_request", key
        assert "pythonic" in error.message and "not constrained yet" in error.message


def test_a_family_without_an_end_marker_is_parsed_to_the_end_of_the_text():
    """Mistral's ``[TOOL_CALLS]`` has no closing marker: the calls run to the end."""
    from mlx_lm.tool_parsers import mistral

    family = toolcalls.Family("mistral", mistral.tool_call_start, "", mistral.parse_tool_call)
    text = 'Sure. [TOOL_CALLS][{"name": "get_time", "arguments": {"zone": "cet"}}]'
    content, calls = toolcalls.parse(text, family, TOOLS)
    assert content == "Sure. " and [c.function.name for c in calls] == ["get_time"]
    content, calls = toolcalls.parse('[TOOL_CALLS]get_time[ARGS]{"zone": "utc"}', family, TOOLS)
    assert content is None and json.loads(calls[0].function.arguments) == {"zone": "utc"}
    assert toolcalls.parse("[TOOL_CALLS]nothing here", family, TOOLS) == (
        "[TOOL_CALLS]nothing here",
        [],
    )


def test_mistral_calls_are_forced_and_validate_on_every_path(conn, redis_url, tmp_path_factory):
    """Mistral's ``[TOOL_CALLS]name[ARGS]{...}`` family: forced (named, required) and
    ``auto`` (pushed into a call by a bias on its marker token) calls validate, equal
    alone, batched and speculative."""
    from worker.dev.tinymodels import ensure_mistral_model

    root = tmp_path_factory.mktemp("mistral")
    path = ensure_mistral_model(root / "m")
    twin = root / "twin"
    shutil.copytree(path, twin)
    entry, _ = ModelCache().get(str(path))
    assert toolcalls.family_of(entry.tokenizer).name == "mistral"
    (marker,) = entry.tokenizer.encode("[TOOL_CALLS]", add_special_tokens=False)
    prompts = ["weather in paris?", "time please", "and in rome"]
    jobs = (
        {f"n{i}": body(path, p) for i, p in enumerate(prompts)}
        | {
            f"r{i}": body(path, p, choice="required", parallel_tool_calls=False)
            for i, p in enumerate(prompts)
        }
        | {
            f"a{i}": body(path, p, choice="auto", parallel_tool_calls=False)
            | {"logit_bias": {str(marker): 100}}
            for i, p in enumerate(prompts)
        }
    )
    alone = run_jobs(conn, redis_url, jobs, "mistral-1", max_batch=1)
    batched = run_jobs(conn, redis_url, jobs, "mistral-4", max_batch=4)
    spec = run_jobs(
        conn,
        redis_url,
        {k: v | {"draft_model": str(twin)} for k, v in jobs.items()},
        "mistral-s",
        max_batch=1,
        policy=SpeculationPolicy("always"),
    )
    for key in jobs:
        calls = calls_of(alone[key])
        assert len(calls[0]) == 1
        if key.startswith("n"):
            assert calls[0][0][0] == "get_weather"
        assert calls_of(batched[key]) == calls_of(spec[key]) == calls, key


@pytest.mark.parametrize("arch", ["gemma3_text", "qwen3_5", "qwen3_moe"])
def test_forced_calls_on_sliding_window_hybrid_and_moe_models(
    conn, redis_url, tmp_path_factory, arch
):
    """The call grammar on the other cache types: a sliding window (gemma3_text, window
    16 under a ~450-token prompt), a hybrid linear-attention model (qwen3_5: recurrent
    state, rewound by replay when speculation rejects) and MoE. Named and auto-pushed
    calls validate and agree alone, batched and speculative."""
    from worker.dev.tinymodels import TinySpec

    root = tmp_path_factory.mktemp(f"tools-{arch}")
    spec = TinySpec(arch=arch, layers=4, hidden=64, intermediate=128, seed=1, context=4096)
    path = ensure_tool_model(root / "m", spec)
    twin = root / "twin"
    shutil.copytree(path, twin)
    entry, _ = ModelCache().get(str(path))
    (marker,) = entry.tokenizer.encode("<tool_call>", add_special_tokens=False)
    prompts = ["weather in paris?", "time please"]
    jobs = {f"n{i}": body(path, p) | {"max_tokens": 200} for i, p in enumerate(prompts)} | {
        f"a{i}": body(path, p, choice="auto", parallel_tool_calls=False)
        | {"logit_bias": {str(marker): 100}, "max_tokens": 200}
        for i, p in enumerate(prompts)
    }
    alone = run_jobs(conn, redis_url, jobs, f"{arch}-1", max_batch=1)
    batched = run_jobs(conn, redis_url, jobs, f"{arch}-4", max_batch=4)
    spec_jobs = {k: v | {"draft_model": str(twin)} for k, v in jobs.items()}
    speculative = run_jobs(
        conn, redis_url, spec_jobs, f"{arch}-s", max_batch=1, policy=SpeculationPolicy("always")
    )
    for key in jobs:
        calls = calls_of(alone[key])
        assert len(calls[0]) == 1, key
        assert calls_of(batched[key]) == calls_of(speculative[key]) == calls, key
    assert speculative["n0"].metrics.speculative
