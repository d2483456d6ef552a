"""OpenAI's Responses API as a translation of chat jobs: a request becomes a chat body,
a chat completion becomes a ``response`` object. No second pipeline: the job that runs
is a chat job, on every path a chat job takes.

:func:`to_chat` turns a Responses request (plus the messages of its
``previous_response_id`` chain) into a chat.completions body; :func:`from_chat`
turns the job's chat.completion into the ``response`` object, and
:func:`conversation` gives the messages a later response in the chain starts from.
"""

from __future__ import annotations

import json
import secrets
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

#: Responses fields mlxq does not implement; a request that sets one is refused by name.
UNSUPPORTED = {
    "background": "background responses are not supported: poll a Batch API batch instead",
    "conversation": "conversations are not supported: chain responses with previous_response_id",
    "include": "include is not supported",
    "prompt": "prompt templates are not supported",
    "service_tier": "service_tier is not supported",
    "truncation": "truncation is not supported (a prompt too long for the model fails)",
}
_HARMLESS = (None, False, [], {}, "auto", "default", "disabled")


class TextFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    format: TextFormat = TextFormat()
    verbosity: str | None = None


class FunctionTool(BaseModel):
    """A Responses function tool (flat: ``name`` and ``parameters`` at the top)."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ResponsesRequest(BaseModel):
    """A ``POST /v1/responses`` body (what mlxq reads of it; unknown fields refused)."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1, max_length=512)
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    text: TextConfig | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    previous_response_id: str | None = Field(default=None, max_length=128)
    store: bool = True
    stream: bool = False
    metadata: dict[str, str] | None = None
    user: str | None = None
    reasoning: dict[str, Any] | None = None
    seed: int | None = None  # mlxq: a seeded sample (chat's ``seed``)
    time_limit_s: float | None = Field(default=None, gt=0)  # mlxq: as on chat
    # refused by name below unless off
    background: Any = None
    conversation: Any = None
    include: Any = None
    prompt: Any = None
    service_tier: Any = None
    truncation: Any = None

    def refused(self) -> str | None:
        """Why this request cannot be served (None: it can)."""
        for name, why in UNSUPPORTED.items():
            if getattr(self, name) not in _HARMLESS:
                return f"{name}: {why}"
        return None


class TranslationError(ValueError):
    """A Responses request that has no chat form (the message says what)."""


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


def _content_of(content: Any, where: str) -> str | list[dict[str, Any]]:
    """A message's content in chat form: its text, or (with an ``input_image``) a list of
    chat parts: text, ``image_url`` (a URL or data URL) and ``file`` (an uploaded image)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise TranslationError(f"{where}.content: must be a string or a list of parts")
    out: list[dict[str, Any]] = []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text"):
            out.append({"type": "text", "text": str(part.get("text", ""))})
        elif kind == "input_image":
            out.append(_image_part(part, f"{where}.content.{i}"))
        elif kind in ("input_file", "input_audio"):
            raise TranslationError(f"{where}.content.{i}: {kind} is not supported")
        else:
            raise TranslationError(f"{where}.content.{i}: unknown part type {kind!r}")
    if all(p["type"] == "text" for p in out):
        return "".join(p["text"] for p in out)
    return out


def _image_part(part: dict[str, Any], where: str) -> dict[str, Any]:
    """An ``input_image`` as a chat part: by ``image_url`` or by ``file_id``."""
    url, file_id = part.get("image_url"), part.get("file_id")
    if isinstance(url, str) and file_id is None:
        detail = part.get("detail", "auto")
        return {"type": "image_url", "image_url": {"url": url, "detail": detail}}
    if isinstance(file_id, str) and url is None:
        return {"type": "file", "file": {"file_id": file_id}}
    raise TranslationError(f"{where}: input_image needs an image_url or a file_id (one)")


def input_messages(value: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Chat messages for a Responses ``input`` (a string, or message and tool items)."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(value):
        where = f"input.{i}"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise TranslationError(
                    f"{where}.role: must be user, system, developer or assistant"
                )
            role = "system" if role == "developer" else role
            messages.append({"role": role, "content": _content_of(item.get("content"), where)})
        elif kind == "function_call":
            call = {
                "id": item.get("call_id") or item.get("id") or new_id("call"),
                "type": "function",
                "function": {"name": item.get("name"), "arguments": item.get("arguments", "{}")},
            }
            if messages and messages[-1]["role"] == "assistant" and messages[-1].get("tool_calls"):
                messages[-1]["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            text = output if isinstance(output, str) else json.dumps(output)
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": text})
        elif kind == "reasoning":
            continue  # a model's earlier thinking is not fed back
        else:
            raise TranslationError(f"{where}.type: {kind!r} items are not supported")
    if not messages:
        raise TranslationError("input: no messages")
    return messages


def to_chat(req: ResponsesRequest, history: list[dict[str, Any]]) -> dict[str, Any]:
    """The chat.completions body that runs ``req`` after the ``history`` messages."""
    messages = list(history)
    if req.instructions:  # instructions are not carried over a chain (as OpenAI)
        messages = [m for m in messages if m.get("role") != "system"]
        messages.insert(0, {"role": "system", "content": req.instructions})
    messages += input_messages(req.input)
    body: dict[str, Any] = {"model": req.model, "messages": messages}
    for src, dst in (
        ("max_output_tokens", "max_tokens"),
        ("temperature", "temperature"),
        ("top_p", "top_p"),
        ("seed", "seed"),
        ("user", "user"),
        ("time_limit_s", "time_limit_s"),
    ):
        value = getattr(req, src)
        if value is not None:
            body[dst] = value
    fmt = req.text.format if req.text else None
    if fmt is not None and fmt.type == "json_object":
        body["response_format"] = {"type": "json_object"}
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None or not fmt.name:
            raise TranslationError("text.format: json_schema needs a name and a schema")
        spec = {"name": fmt.name, "schema": fmt.json_schema}
        if fmt.strict is not None:
            spec["strict"] = fmt.strict
        body["response_format"] = {"type": "json_schema", "json_schema": spec}
    if req.tools:
        body["tools"] = [
            {"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
            for t in req.tools
        ]
    choice = req.tool_choice
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not choice.get("name"):
            raise TranslationError("tool_choice: give none, auto, required or a function's name")
        body["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
    elif choice is not None:
        body["tool_choice"] = choice
    if req.reasoning and req.reasoning.get("effort"):
        body["reasoning_effort"] = req.reasoning["effort"]
    return body


def from_chat(
    completion: dict[str, Any], req: ResponsesRequest, response_id: str, created: int
) -> dict[str, Any]:
    """The ``response`` object for the job's chat.completion."""
    choice = completion["choices"][0]
    message = choice.get("message") or {}
    output: list[dict[str, Any]] = []
    if message.get("reasoning_content"):
        output.append(
            {
                "type": "reasoning",
                "id": new_id("rs"),
                "summary": [],
                "content": [{"type": "reasoning_text", "text": message["reasoning_content"]}],
            }
        )
    if message.get("content") is not None:
        output.append(
            {
                "type": "message",
                "id": new_id("msg"),
                "status": "completed",
                "role": "assistant",
                "content": [{"type": "output_text", "text": message["content"], "annotations": []}],
            }
        )
    for call in message.get("tool_calls") or []:
        output.append(
            {
                "type": "function_call",
                "id": new_id("fc"),
                "call_id": call["id"],
                "name": call["function"]["name"],
                "arguments": call["function"]["arguments"],
                "status": "completed",
            }
        )
    usage = completion.get("usage") or {}
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    thought = (usage.get("completion_tokens_details") or {}).get("reasoning_tokens", 0)
    cut = choice.get("finish_reason") == "length"
    return {
        "id": response_id,
        "object": "response",
        "created_at": created,
        "status": "incomplete" if cut else "completed",
        "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
        "error": None,
        "model": completion.get("model", req.model),
        "output": output,
        "usage": {
            "input_tokens": usage.get("prompt_tokens", 0),
            "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": usage.get("completion_tokens", 0),
            "output_tokens_details": {"reasoning_tokens": thought},
            "total_tokens": usage.get("total_tokens", 0),
        },
        "previous_response_id": req.previous_response_id,
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "text": (req.text or TextConfig()).model_dump(by_alias=True, exclude_none=True),
        "tools": [t.model_dump(exclude_none=True) for t in req.tools or []],
        "tool_choice": req.tool_choice or "auto",
        "parallel_tool_calls": req.parallel_tool_calls is not False,
        "store": req.store,
        "metadata": req.metadata or {},
        "user": req.user,
    }


def conversation(body: dict[str, Any], completion: dict[str, Any]) -> list[dict[str, Any]]:
    """The messages a response chained after this one starts from: the chat body's and
    the answer (its text and tool calls)."""
    message = completion["choices"][0].get("message") or {}
    answer: dict[str, Any] = {"role": "assistant", "content": message.get("content")}
    if message.get("tool_calls"):
        answer["tool_calls"] = message["tool_calls"]
    return [*body["messages"], answer]
