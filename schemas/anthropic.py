"""Anthropic's Messages API as a translation of chat jobs: a request becomes a chat body,
a chat completion becomes a ``message``. No second pipeline: the job that runs is a chat
job, on every path a chat job takes (alone, batched, speculative, streamed).

:func:`to_chat` turns a ``POST /v1/messages`` body into a chat.completions body;
:func:`from_chat` turns the job's chat.completion into Anthropic's ``message`` object;
:func:`error_body` gives Anthropic's error shape. Fields mlxq cannot honour are refused
by name (:data:`UNSUPPORTED`), never ignored.
"""

from __future__ import annotations

import json
import secrets
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from schemas.responses import TranslationError  # (one error for every translation)

#: Messages fields mlxq does not implement; a request that sets one is refused by name.
UNSUPPORTED = {
    "container": "containers (code execution) are not supported",
    "mcp_servers": "MCP servers are not supported: run the tools in your client",
    "context_management": "context management is not supported",
}
#: Values of ``service_tier`` that ask for nothing mlxq would have to do.
HARMLESS_TIERS = (None, "auto", "standard_only")
#: Tool types other than a client (custom) tool: Anthropic's server tools, refused.
CLIENT_TOOL_TYPES = (None, "custom")
#: Chat finish reasons as Anthropic stop reasons (a stop string: ``stop_sequence``).
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}
#: Anthropic error types by HTTP status.
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    504: "api_error",
}


class ToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class Thinking(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = Field(default=None, ge=1)
    display: Literal["summarized", "omitted"] | None = None


class OutputFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    type: Literal["json_schema"]
    json_schema: dict[str, Any] = Field(alias="schema")


class OutputConfig(BaseModel):
    """Structured output (``format``) and effort (the template's ``reasoning_effort``)."""

    model_config = ConfigDict(extra="forbid")

    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    format: OutputFormat | None = None


class ToolDef(BaseModel):
    """A client tool: the model calls it, the client runs it."""

    model_config = ConfigDict(extra="allow")  # (a server tool's own fields: refused by type)

    name: str = Field(min_length=1, max_length=128)
    description: str | None = None
    input_schema: dict[str, Any] | None = None
    type: str | None = None
    cache_control: dict[str, Any] | None = None  # (a prompt-cache hint: mlxq caches anyway)


class MessagesRequest(BaseModel):
    """A ``POST /v1/messages`` body (what mlxq reads of it; unknown fields refused)."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1, max_length=512)
    max_tokens: int = Field(ge=1)
    messages: list[dict[str, Any]] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=1.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)
    stop_sequences: list[str] | None = Field(default=None, max_length=4)
    stream: bool = False
    metadata: dict[str, Any] | None = None
    tools: list[ToolDef] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None
    service_tier: str | None = None
    cache_control: dict[str, Any] | None = None  # (a prompt-cache hint: mlxq caches anyway)
    # mlxq's own, as on chat
    seed: int | None = None
    time_limit_s: float | None = Field(default=None, gt=0)
    draft_model: str | None = Field(default=None, min_length=1, max_length=512)
    # refused by name unless absent
    container: Any = None
    mcp_servers: Any = None
    context_management: Any = None

    def refused(self) -> str | None:
        """Why this request cannot be served (None: it can)."""
        for name, why in UNSUPPORTED.items():
            if getattr(self, name) not in (None, [], {}):
                return f"{name}: {why}"
        if self.service_tier not in HARMLESS_TIERS:
            return f"service_tier: {self.service_tier!r} is not supported (auto, standard_only)"
        for i, tool in enumerate(self.tools or []):
            if tool.type not in CLIENT_TOOL_TYPES:
                return f"tools.{i}.type: server tools ({tool.type}) are not supported"
            if tool.input_schema is None:
                return f"tools.{i}.input_schema: a client tool needs its input schema"
            if tool.model_extra:
                return f"tools.{i}: unknown fields {sorted(tool.model_extra)}"
        choice = self.tool_choice
        if choice is not None and choice.type == "tool" and not choice.name:
            return "tool_choice: type 'tool' needs the tool's name"
        if choice is not None and choice.type in ("any", "tool") and not self.tools:
            return f"tool_choice: {choice.type!r} needs tools"
        return None


def new_id(prefix: str = "msg") -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


def _text_of(blocks: str | list[dict[str, Any]], where: str) -> str:
    """The text of ``system`` or a tool result: a string, or text blocks."""
    if isinstance(blocks, str):
        return blocks
    if not isinstance(blocks, list):
        raise TranslationError(f"{where}: must be a string or a list of text blocks")
    out = []
    for i, block in enumerate(blocks):
        if not isinstance(block, dict) or block.get("type") != "text":
            kind = block.get("type") if isinstance(block, dict) else type(block).__name__
            raise TranslationError(f"{where}.{i}: only text blocks are read here, not {kind!r}")
        out.append(str(block.get("text", "")))
    return "".join(out)


def _image(block: dict[str, Any], where: str) -> dict[str, Any]:
    """An image block as a chat ``image_url`` part (base64 as a data URL, or a URL)."""
    source = block.get("source")
    kind = source.get("type") if isinstance(source, dict) else None
    if kind == "base64":
        media, data = source.get("media_type"), source.get("data")
        if (
            not isinstance(media, str)
            or not media.startswith("image/")
            or not isinstance(data, str)
        ):
            raise TranslationError(f"{where}.source: base64 needs media_type image/... and data")
        return {"type": "image_url", "image_url": {"url": f"data:{media};base64,{data}"}}
    if kind == "url" and isinstance(source.get("url"), str):
        return {"type": "image_url", "image_url": {"url": source["url"]}}
    raise TranslationError(f"{where}.source: give a base64 or url source (files are not read)")


def _message(message: dict[str, Any], i: int) -> list[dict[str, Any]]:
    """The chat messages of one Messages message (tool results become tool messages)."""
    where = f"messages.{i}"
    role, content = message.get("role"), message.get("content")
    if role not in ("user", "assistant"):
        raise TranslationError(f"{where}.role: must be user or assistant")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise TranslationError(f"{where}.content: must be a string or a list of blocks")
    tools: list[dict[str, Any]] = []  # tool messages (a user's tool results), first
    parts: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    for j, block in enumerate(content):
        at = f"{where}.content.{j}"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            parts.append({"type": "text", "text": str(block.get("text", ""))})
        elif kind == "image" and role == "user":
            parts.append(_image(block, at))
        elif kind == "tool_use" and role == "assistant":
            arguments = json.dumps(block.get("input") or {}, separators=(",", ":"))
            call = {"name": block.get("name"), "arguments": arguments}
            calls.append({"id": block.get("id"), "type": "function", "function": call})
        elif kind == "tool_result" and role == "user":
            result = block.get("content", "")
            text = _text_of(result if result is not None else "", f"{at}.content")
            if block.get("is_error"):
                text = f"Error: {text}"
            tools.append(
                {"role": "tool", "tool_call_id": block.get("tool_use_id"), "content": text}
            )
        elif kind in ("thinking", "redacted_thinking") and role == "assistant":
            continue  # a model's earlier thinking is not fed back
        else:
            raise TranslationError(f"{at}.type: {kind!r} blocks are not supported in {role} turns")
    out = list(tools)
    if parts or calls or not tools:
        text_only = all(p["type"] == "text" for p in parts)
        body: Any = "".join(p["text"] for p in parts) if text_only else parts
        msg: dict[str, Any] = {"role": role, "content": body if parts or not calls else None}
        if calls:
            msg["tool_calls"] = calls
        out.append(msg)
    return out


def to_chat(req: MessagesRequest) -> dict[str, Any]:
    """The chat.completions body that runs ``req``."""
    messages: list[dict[str, Any]] = []
    if req.system:
        messages.append({"role": "system", "content": _text_of(req.system, "system")})
    for i, message in enumerate(req.messages):
        if not isinstance(message, dict):
            raise TranslationError(f"messages.{i}: must be an object")
        messages += _message(message, i)
    body: dict[str, Any] = {"model": req.model, "messages": messages, "max_tokens": req.max_tokens}
    for src, dst in (
        ("temperature", "temperature"),
        ("top_p", "top_p"),
        ("top_k", "top_k"),
        ("stop_sequences", "stop"),
        ("seed", "seed"),
        ("time_limit_s", "time_limit_s"),
        ("draft_model", "draft_model"),
    ):
        value = getattr(req, src)
        if value is not None:
            body[dst] = value
    user = (req.metadata or {}).get("user_id")
    if isinstance(user, str):
        body["user"] = user
    if req.tools:
        body["tools"] = [
            {
                "type": "function",
                "function": {"name": t.name, "parameters": t.input_schema or {}}
                | ({"description": t.description} if t.description else {}),
            }
            for t in req.tools
        ]
    choice = req.tool_choice
    if choice is not None:
        if choice.type == "tool":
            body["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
        else:
            body["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[choice.type]
        if choice.disable_parallel_tool_use and req.tools:
            body["parallel_tool_calls"] = False
    if req.thinking is not None:  # the template's switch, and the thinking budget
        body["chat_template_kwargs"] = {"enable_thinking": req.thinking.type != "disabled"}
        if req.thinking.type == "enabled" and req.thinking.budget_tokens is not None:
            body["thinking_budget"] = req.thinking.budget_tokens
    config = req.output_config
    if config is not None and config.format is not None:
        spec = {"name": "output", "schema": config.format.json_schema}
        body["response_format"] = {"type": "json_schema", "json_schema": spec}
    if config is not None and config.effort is not None:
        body["reasoning_effort"] = {"xhigh": "high", "max": "high"}.get(
            config.effort, config.effort
        )
    if req.stream:
        body["stream"] = True
    return body


def from_chat(completion: dict[str, Any], model: str, message_id: str) -> dict[str, Any]:
    """Anthropic's ``message`` object for the job's chat.completion."""
    choice = completion["choices"][0]
    message = choice.get("message") or {}
    content: list[dict[str, Any]] = []
    if message.get("reasoning_content"):
        content.append(
            {"type": "thinking", "thinking": message["reasoning_content"], "signature": ""}
        )
    if message.get("content"):
        content.append({"type": "text", "text": message["content"]})
    for call in message.get("tool_calls") or []:
        content.append(
            {
                "type": "tool_use",
                "id": call["id"],
                "name": call["function"]["name"],
                "input": _arguments(call["function"]["arguments"]),
            }
        )
    reason, sequence = stop_reason(choice)
    return {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": completion.get("model", model),
        "content": content,
        "stop_reason": reason,
        "stop_sequence": sequence,
        "usage": usage(completion.get("usage") or {}),
    }


def stop_reason(choice: dict[str, Any]) -> tuple[str, str | None]:
    """(Anthropic's ``stop_reason``, the stop sequence met) of a chat choice."""
    if choice.get("stop_reason"):
        return "stop_sequence", choice["stop_reason"]
    return STOP_REASONS.get(choice.get("finish_reason") or "stop", "end_turn"), None


def usage(chat_usage: dict[str, Any]) -> dict[str, Any]:
    """Anthropic's usage: input tokens not read from the prefix cache, those read, output."""
    prompt = chat_usage.get("prompt_tokens", 0)
    cached = (chat_usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {
        "input_tokens": prompt - cached,
        "output_tokens": chat_usage.get("completion_tokens", 0),
        "cache_read_input_tokens": cached,
        "cache_creation_input_tokens": 0,
    }


def _arguments(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return {}  # (a forced call always parses; a free one that did not: no input)


def error_body(status: int, message: str) -> dict[str, Any]:
    """Anthropic's error object for an HTTP ``status``."""
    kind = ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}
