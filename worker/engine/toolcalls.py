"""Tool calls on a model: its family's call format, the grammar that forces a call, and
the calls parsed out of its text.

The family is what mlx-lm infers from the model's chat template and vocabulary
(``TokenizerWrapper.tool_parser`` and its call markers), so any family mlx-lm parses
works for ``tool_choice`` ``auto``. Calls are decoded under an llguidance grammar of
the family's envelope around the functions' ``parameters`` schemas, so their
arguments always parse and validate: a forced call (``required`` or a named
function) from the first token, a call under ``auto`` from the moment the model
writes the call marker (the text before it is free). That needs the envelope's exact
shape, known here for Hermes / Qwen's
``<tool_call>\n{"name": ..., "arguments": ...}\n</tool_call>`` and Mistral's
``[TOOL_CALLS]name[ARGS]{...}`` (or its v0.3 JSON array); other families are parsed,
and refused by name for forced calls and strict tools.
"""

from __future__ import annotations

import hashlib
import json
import re
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import llguidance

from schemas import ChatRequest, InvalidRequestError
from schemas.tools import FunctionCall, FunctionDef, NamedToolChoice, ToolCall

#: Whitespace between a call's JSON tokens: one space at most (a model cannot spend
#: its tokens on whitespace).
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
    strict = [t.function.name for t in request.tools or () if t.function.strict]
    if strict and family.name not in CONSTRAINED:
        raise InvalidRequestError(
            f"strict tools ({', '.join(strict)}) cannot be enforced on model {model!r}: "
            f"its tool-call format ({family.name}) is parsed but not constrained yet"
        )
    if request.forced_call is not None and family.name not in CONSTRAINED:
        raise InvalidRequestError(
            f"tool_choice {_choice(request)} cannot be enforced on model {model!r}: its "
            f"tool-call format ({family.name}) is parsed but not constrained yet "
            "(constrained: Hermes/Qwen <tool_call> JSON and Mistral [TOOL_CALLS]); "
            "use tool_choice 'auto'"
        )
    return family


def _choice(request: ChatRequest) -> str:
    choice = request.tool_choice
    return repr(choice) if isinstance(choice, str) else f"{{function: {choice.function.name!r}}}"  # type: ignore[union-attr]


def _literal(text: str, tokenizer: Any) -> str:
    """``text`` in a Lark grammar: an added token (Qwen's ``<tool_call>``, special or
    not) by its id, since llguidance does not match an added token to a grammar's
    string literal (it marks them special); anything else as a string."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) == 1 and ids[0] in getattr(tokenizer, "added_tokens_decoder", {}):
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


def grammar(
    request: ChatRequest, tokenizer: Any, family: Family | None
) -> tuple[str | None, tuple[int, ...]]:
    """The llguidance grammar of the request's tool calls and the tokens that switch it
    on. A forced call (``required``, a named function): the grammar holds from the first
    token. ``auto``: free text until the model writes the call marker, then the rest of
    the call under the grammar, so whatever call it makes validates. (None, ()) when no
    call is constrained (no tools, ``none``, or a family not constrained yet)."""
    if family is None or family.name not in CONSTRAINED or not request.tools:
        return None, ()
    forced = request.forced_call
    functions = forced if forced is not None else [t.function for t in request.tools]
    several = request.parallel_calls and not isinstance(request.tool_choice, NamedToolChoice)
    start = _literal(family.start, tokenizer)
    end = _literal(family.end, tokenizer) if family.end else ""
    rules = CONSTRAINED[family.name](functions, several, start, end, tokenizer)
    if forced is not None:
        lines, trigger = [f"start: {start} calls", *rules], ()
    else:  # after the marker the model wrote
        lines = ["start: calls", *rules]
        trigger = tuple(int(t) for t in tokenizer.encode(family.start, add_special_tokens=False))
    return llguidance.LLMatcher.grammar_from_lark("\n".join(lines)), trigger


def _hermes(
    functions: list[FunctionDef], several: bool, start: str, end: str, tokenizer: Any
) -> list[str]:
    """``START\n{"name": ..., "arguments": ...}\nEND``, repeated on new lines."""
    return [
        f'calls: "\\n" obj "\\n" {end} ("\\n" {start} "\\n" obj "\\n" {end})*'
        if several
        else f'calls: "\\n" obj "\\n" {end}',
        f"obj: %json {json.dumps(call_schema(functions))}",
    ]


def _mistral(
    functions: list[FunctionDef], several: bool, start: str, end: str, tokenizer: Any
) -> list[str]:
    """Mistral's forms, as the model's template writes them: ``name[ARGS]{...}``
    (templates that render ``[ARGS]``, Mistral's 2025 models) or a JSON array of
    ``{"name", "arguments"}`` (v0.3)."""
    template = str(getattr(tokenizer, "chat_template", "") or "")
    if "[ARGS]" not in template:
        items: dict[str, Any] = {"type": "array", "items": call_schema(functions), "minItems": 1}
        if not several:
            items["maxItems"] = 1
        return ['calls: " "? arr', f"arr: %json {json.dumps(items)}"]
    args = _literal("[ARGS]", tokenizer)
    lines = ["calls: call+" if several else "calls: call"]
    lines.append("call: " + " | ".join(f"c{i}" for i in range(len(functions))))
    for i, f in enumerate(functions):
        schema = f.schema | {"x-guidance": {"whitespace_pattern": CALL_WHITESPACE}}
        lines.append(f"c{i}: {json.dumps(f.name)} {args} a{i}")
        lines.append(f"a{i}: %json {json.dumps(schema)}")
    return lines


#: Families whose calls are constrained: their grammar rules after the call marker.
CONSTRAINED = {"json_tools": _hermes, "mistral": _mistral}


def call_id(completion_id: str, choice: int, n: int) -> str:
    """A call's id: the same in a streamed job's chunks and in its record."""
    digest = hashlib.sha1(f"{completion_id}:{choice}:{n}".encode()).hexdigest()
    return f"call_{digest[:24]}"


#: Where a call's JSON arguments begin, per family (after the match).
_ARGUMENTS = {
    "json_tools": (re.compile(r'"arguments"\s*:\s*'),),
    "mistral": (re.compile(r"\[ARGS\]\s*"), re.compile(r'"arguments"\s*:\s*')),
}
_NAME = {
    "json_tools": re.compile(r'"name"\s*:\s*"((?:[^"\\]|\\.)*)"'),
    "mistral": re.compile(r'(?:"name"\s*:\s*"((?:[^"\\]|\\.)*)"|([\w-]+)\s*\[ARGS\])'),
}


def live_calls(family: Family, body: str) -> list[tuple[str, str, bool]]:
    """The calls in a call body as far as the model has written them: (name, its
    arguments so far, complete). Arguments so far never hold a trailing ``}`` or
    whitespace that could be the envelope's, so they are always a prefix of the
    arguments :func:`parse` returns. [] for families whose arguments are not JSON."""
    starts, names = _ARGUMENTS.get(family.name), _NAME.get(family.name)
    if starts is None or names is None:
        return []
    decoder = json.JSONDecoder()
    out: list[tuple[str, str, bool]] = []
    for pattern in starts:
        found = list(pattern.finditer(body))
        if not found:
            continue
        for k, m in enumerate(found):
            head = body[found[k - 1].end() if k else 0 : m.end()]
            named = list(names.finditer(head))
            if not named:
                break
            name = next(g for g in named[-1].groups() if g is not None)
            try:
                _, end = decoder.raw_decode(body, m.end())
                out.append((name, body[m.end() : end], True))
            except ValueError:
                out.append((name, body[m.end() :].rstrip("} \t\r\n"), False))
                break
        return out
    return out


def parse(
    text: str, family: Family, tools: Any, ids: Callable[[int], str] | None = None
) -> tuple[str | None, list[ToolCall]]:
    """``text`` split into its content (None if nothing but calls) and its calls. A call
    that does not parse (cut short by max_tokens, under ``auto``) stays in the content:
    nothing the model wrote is dropped. A call's arguments are the JSON text the model
    wrote (what a stream sends), when its family's arguments are JSON; ``ids`` names
    the n-th call (default: random ids)."""
    content: list[str] = []
    calls: list[ToolCall] = []
    rest = text
    while (i := rest.find(family.start)) >= 0:
        # A family without an end marker (Mistral's) calls to the end of the text.
        j = rest.find(family.end, i + len(family.start)) if family.end else len(rest)
        if j < 0:
            break
        body = rest[i + len(family.start) : j]
        try:
            parsed = family.parser(body, tools)
            if not parsed:
                raise ValueError("no call")
        except (ValueError, KeyError, TypeError, SyntaxError):
            content.append(rest[: j + len(family.end)])
        else:
            content.append(rest[:i])
            found = parsed if isinstance(parsed, list) else [parsed]
            raw = [a for _, a, done in live_calls(family, body) if done]
            if len(raw) != len(found) or any(
                json.loads(r) != c.get("arguments") for r, c in zip(raw, found, strict=False)
            ):
                raw = []
            for k, call in enumerate(found):
                n = len(calls)
                calls.append(_call(call, raw[k] if raw else None, ids(n) if ids else None))
        rest = rest[j + len(family.end) :]
    content.append(rest)
    joined = "".join(content)
    if calls and not joined.strip():
        return None, calls
    return joined, calls


def _call(parsed: dict[str, Any], raw: str | None, named: str | None) -> ToolCall:
    arguments = parsed.get("arguments", {})
    if raw is None:
        raw = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return ToolCall(
        id=named or str(parsed.get("id") or f"call_{secrets.token_hex(12)}"),
        function=FunctionCall(name=str(parsed["name"]), arguments=raw),
    )
