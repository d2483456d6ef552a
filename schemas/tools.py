"""Tool calls in requests and responses: OpenAI's ``tools``, ``tool_choice`` and the
``tool_calls`` of assistant messages.

A request's tools are checked here, with no model: names, parameter schemas (each
must be a JSON-schema object that llguidance can enforce, as for
``response_format``), and a ``tool_choice`` that names a tool the request has. The
worker renders the tools through the model's own chat template, parses the calls
with mlx-lm's tool parser for the model's family, and, when the request requires a
call (``tool_choice`` ``required`` or a named function), decodes it under a grammar
so its arguments always parse and validate (``worker.engine.toolcalls``).
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from schemas.structured import MAX_SCHEMA_BYTES, SchemaError, compact, grammar_for

#: The most tools one request may offer.
MAX_TOOLS = 128
#: A function's name, as OpenAI allows it.
NAME_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"
#: ``parameters`` when a function declares none: it takes no arguments.
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


class FunctionDef(BaseModel):
    """A function the model may call."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(pattern=NAME_PATTERN)
    description: str | None = Field(default=None, max_length=16_384)
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @field_validator("parameters")
    @classmethod
    def _object_schema(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is None:
            return None
        kind = value.get("type", "object")
        if kind != "object":
            raise ValueError(
                f"parameters must be a JSON schema of an object (type 'object'), not {kind!r}"
            )
        try:
            grammar_for(value)  # the size limit and keywords llguidance cannot enforce
        except SchemaError as e:
            raise ValueError(f"parameters cannot be enforced: {e}") from None
        return value

    @property
    def schema(self) -> dict[str, Any]:
        """The JSON schema its arguments follow."""
        return self.parameters if self.parameters is not None else NO_PARAMETERS


class Tool(BaseModel):
    """OpenAI's ``{"type": "function", "function": {...}}``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    type: Literal["function"]
    function: FunctionDef


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(pattern=NAME_PATTERN)


class NamedToolChoice(BaseModel):
    """``tool_choice: {"type": "function", "function": {"name": ...}}``: call this one."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class FunctionCall(BaseModel):
    """A call's function: its name and its arguments as a JSON string (OpenAI's shape)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1, max_length=64)
    arguments: str = Field(max_length=MAX_SCHEMA_BYTES * 4)

    @property
    def parsed_arguments(self) -> Any:
        """The arguments as JSON (a string that is not JSON stays a string)."""
        try:
            return json.loads(self.arguments)
        except ValueError:
            return self.arguments


class ToolCall(BaseModel):
    """One call an assistant message made (in a history, or in a response)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    id: str = Field(min_length=1, max_length=128)
    type: Literal["function"] = "function"
    function: FunctionCall
    index: int | None = None  # a streamed call's; accepted when a history echoes it back


def check_tools(tools: list[Tool] | None, choice: ToolChoice | None) -> None:
    """What a request's tools and tool_choice must agree on; ValueError naming it."""
    if not tools:
        if choice not in (None, "none", "auto"):
            raise ValueError("tool_choice names a call but the request has no tools")
        return
    if len(tools) > MAX_TOOLS:
        raise ValueError(f"tools: at most {MAX_TOOLS} tools, not {len(tools)}")
    names = [t.function.name for t in tools]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"tools: function names must be unique ({', '.join(twice)} twice)")
    size = len(compact([t.model_dump(exclude_none=True) for t in tools]).encode())
    if size > MAX_SCHEMA_BYTES:
        raise ValueError(f"tools: {size} bytes as JSON; at most {MAX_SCHEMA_BYTES}")
    if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
        raise ValueError(
            f"tool_choice names {choice.function.name!r}, which is not among the tools "
            f"({', '.join(names)})"
        )


def called(tools: list[Tool], choice: ToolChoice | None) -> list[FunctionDef] | None:
    """The functions a forced call chooses among (None: no call is forced)."""
    if choice == "required":
        return [t.function for t in tools]
    if isinstance(choice, NamedToolChoice):
        return [t.function for t in tools if t.function.name == choice.function.name]
    return None
