"""Tool calls on a model: its family's call format, the grammar that forces a call, and
the calls parsed out of its text.

The family is what mlx-lm infers from the model's chat template and vocabulary
(``TokenizerWrapper.tool_parser`` and its call markers), so any family mlx-lm parses
works for ``tool_choice`` ``auto``. A forced call (``required`` or a named function)
is decoded under an llguidance grammar of the family's envelope around the
function's ``parameters`` schema, so its arguments always parse and validate; that
needs the envelope's exact shape, known here for the JSON families (Hermes / Qwen's
``<tool_call>{"name": ..., "arguments": ...}</tool_call>``). Other families are
refused by name for forced calls.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass
from typing import Any

from schemas import ChatRequest, InvalidRequestError
from schemas.tools import FunctionCall, FunctionDef, ToolCall

#: mlx-lm parser modules whose calls are ``START json END`` with {"name", "arguments"}.
JSON_FAMILIES = frozenset({"json_tools"})
#: Whitespace between a call's JSON tokens: one space at most (the arguments are
#: re-serialized anyway; a model cannot spend its tokens on whitespace).
CALL_WHITESPACE = "[\\x20]{0,1}"


@dataclass(frozen=True)
class Family:
    """A model's tool-call format, as mlx-lm knows it."""

    name: str  # the mlx-lm parser module, e.g. "json_tools"
    start: str
    end: str
    parser: Any  # mlx-lm's ``parse_tool_call(text, tools)``


def family_of(tokenizer: Any) -> Family | None:
    """The model's tool-call family; None if mlx-lm finds none for it."""
    if not getattr(tokenizer, "has_tool_calling", False):
        return None
    parser = tokenizer.tool_parser
    name = getattr(parser, "__module__", "").rsplit(".", 1)[-1]
    return Family(name, tokenizer.tool_call_start, tokenizer.tool_call_end, parser)


def check(request: ChatRequest, tokenizer: Any, model: str) -> Family | None:
    """The family the request's tools run with on this model; InvalidRequestError if the
    model has no tool calling, or cannot force the call the request requires."""
    if not request.uses_tools:
        return None
    family = family_of(tokenizer)
    if family is None:
        raise InvalidRequestError(
            f"model {model!r} does not support tool calling: mlx-lm finds no tool-call "
            "format in its chat template"
        )
    if request.forced_call is not None and family.name not in JSON_FAMILIES:
        raise InvalidRequestError(
            f"tool_choice {_choice(request)} cannot be enforced on model {model!r}: its "
            f"tool-call format ({family.name}) is parsed but not constrained yet "
            "(only the JSON <tool_call> format is); use tool_choice 'auto'"
        )
    return family


def _choice(request: ChatRequest) -> str:
    choice = request.tool_choice
    return repr(choice) if isinstance(choice, str) else f"{{function: {choice.function.name!r}}}"  # type: ignore[union-attr]


def _literal(text: str, tokenizer: Any) -> str:
    """``text`` in a Lark grammar: a special token by its id (llguidance never matches
    a special token as text), anything else as a string."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    added = getattr(tokenizer, "added_tokens_decoder", {})
    if len(ids) == 1 and getattr(added.get(ids[0]), "special", False):
        return f"<[{ids[0]}]>"
    return json.dumps(text)


def call_schema(functions: list[FunctionDef]) -> dict[str, Any]:
    """The JSON schema of one call's object: a function's name and its arguments."""
    options = [
        {
            "type": "object",
            "properties": {"name": {"const": f.name}, "arguments": f.schema},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for f in functions
    ]
    schema: dict[str, Any] = options[0] if len(options) == 1 else {"anyOf": options}
    return schema | {"x-guidance": {"whitespace_pattern": CALL_WHITESPACE}}


def grammar(request: ChatRequest, tokenizer: Any, family: Family | None) -> str | None:
    """The llguidance grammar that forces the call the request requires (None: none)."""
    functions = request.forced_call
    if functions is None or family is None:
        return None
    import llguidance

    several = request.tool_choice == "required" and request.parallel_calls
    start, end = _literal(family.start, tokenizer), _literal(family.end, tokenizer)
    lark = "\n".join(
        [
            'start: call ("\\n" call)*' if several else "start: call",
            f'call: {start} "\\n" obj "\\n" {end}',
            f"obj: %json {json.dumps(call_schema(functions))}",
        ]
    )
    return llguidance.LLMatcher.grammar_from_lark(lark)


def parse(text: str, family: Family, tools: Any) -> tuple[str | None, list[ToolCall]]:
    """``text`` split into its content (None if nothing but calls) and its calls. A call
    that does not parse (cut short by max_tokens, under ``auto``) stays in the content:
    nothing the model wrote is dropped."""
    content: list[str] = []
    calls: list[ToolCall] = []
    rest = text
    while (i := rest.find(family.start)) >= 0:
        j = rest.find(family.end, i + len(family.start))
        if j < 0:
            break
        body = rest[i + len(family.start) : j]
        try:
            parsed = family.parser(body, tools)
        except (ValueError, KeyError, TypeError, SyntaxError):
            content.append(rest[: j + len(family.end)])
        else:
            content.append(rest[:i])
            for call in parsed if isinstance(parsed, list) else [parsed]:
                calls.append(_call(call))
        rest = rest[j + len(family.end) :]
    content.append(rest)
    joined = "".join(content)
    if calls and not joined.strip():
        return None, calls
    return joined, calls


def _call(parsed: dict[str, Any]) -> ToolCall:
    arguments = parsed.get("arguments", {})
    return ToolCall(
        id=str(parsed.get("id") or f"call_{secrets.token_hex(12)}"),
        function=FunctionCall(
            name=str(parsed["name"]),
            arguments=arguments
            if isinstance(arguments, str)
            else json.dumps(arguments, ensure_ascii=False),
        ),
    )
