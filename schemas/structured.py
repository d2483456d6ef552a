"""Constrained output: the JSON a job must produce (``response_format``), or a regex, a
choice of strings or a lark grammar (``structured_outputs``), compiled to an llguidance
grammar.

Turning a JSON schema into a grammar needs no tokenizer and no model, so producers
and the gateway refuse a schema that cannot be enforced before anything is queued,
and a worker refuses it again (a job hash may come from anywhere) with the same
message. Workers build the token mask from the grammar (``worker.engine.constrain``).

Why llguidance (``bench/grammar.py`` measures llguidance, xgrammar and outlines-core
on a 32,000-entry byte-level BPE; figures in docs/benchmarks.md): no dependencies (xgrammar
requires torch), no per-schema compile stall (about 1 ms, lazily; outlines-core
takes ~300 ms per schema), rollback and draft-token masks for speculative decoding,
and it names the keyword it cannot enforce instead of ignoring it.
"""

from __future__ import annotations

import functools
import json
from typing import Any

import llguidance

#: The largest ``json_schema.schema`` accepted, as compact JSON.
MAX_SCHEMA_BYTES = 64 * 1024

#: How JSON output may be laid out (a request's ``json_whitespace``), as llguidance's
#: options. ``compact`` (the default): no whitespace at all (``{"a":1,"b":[2,3]}``, as
#: ``JSON.stringify`` writes it), so a model that likes whitespace cannot spend its
#: budget on it (vLLM's ``disable-any-whitespace`` answers the same failure), and no
#: vocabulary needs a token for a space to write it. ``indented``: for models that
#: write JSON better pretty-printed: each gap between tokens may hold one space, or
#: one newline and at most 32 spaces or tabs of indent.
LAYOUTS: dict[str, dict[str, Any]] = {
    "compact": {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"},
    "indented": {"whitespace_flexible": True, "whitespace_pattern": r"\x20|\n[\x20\x09]{0,32}"},
}
DEFAULT_LAYOUT = "compact"

#: ``{"type": "json_object"}``: any JSON object.
ANY_OBJECT: dict[str, Any] = {"type": "object"}


class SchemaError(ValueError):
    """A schema llguidance cannot enforce; the message names what it cannot."""


def compact(schema: Any) -> str:
    """``schema`` as compact JSON, its keys in the order given: the order of an object's
    properties is the order the output writes them (OpenAI's too), so a schema of
    ``reasoning`` then ``answer`` reasons first. It is also the key of compiled grammars."""
    return json.dumps(schema, separators=(",", ":"), ensure_ascii=False)


def grammar_for(schema: dict[str, Any] | bool, layout: str = DEFAULT_LAYOUT) -> str:
    """The llguidance grammar that enforces JSON ``schema``, laid out as ``layout`` (one
    of :data:`LAYOUTS`); :class:`SchemaError` if none.

    Keywords llguidance cannot enforce (``uniqueItems``, ``not``, ...) are errors,
    never ignored: the output would not be guaranteed to validate. The layout
    overrides any ``x-guidance`` options the schema carries.
    """
    text = compact(schema)
    if len(text.encode()) > MAX_SCHEMA_BYTES:
        raise SchemaError(
            f"the schema is {len(text.encode())} bytes as JSON; at most {MAX_SCHEMA_BYTES}"
        )
    if layout not in LAYOUTS:
        raise SchemaError(f"json_whitespace {layout!r} is none of {', '.join(LAYOUTS)}")
    return _grammar(text, layout)


@functools.lru_cache(maxsize=256)
def _grammar(text: str, layout: str) -> str:
    # Batch files repeat one schema on every line: each distinct schema compiles once.
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(text, overrides=LAYOUTS[layout])
    except ValueError as e:
        raise SchemaError(str(e)) from None
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        raise SchemaError(error.splitlines()[0])
    return grammar


#: The longest regex, choice list (as JSON) or lark grammar accepted, in bytes.
MAX_GRAMMAR_BYTES = 64 * 1024
#: The most strings a ``choice`` may list.
MAX_CHOICES = 1024


def grammar_of_regex(regex: str) -> str:
    """The grammar whose output matches ``regex`` whole (llguidance's regex syntax: Rust's,
    without look-around or back-references); :class:`SchemaError` naming what is wrong."""
    _check_size(regex)
    return _checked(llguidance.LLMatcher.grammar_from_regex(regex))


def grammar_of_choice(choices: list[str]) -> str:
    """The grammar whose output is exactly one of ``choices``."""
    if not choices or len(choices) > MAX_CHOICES:
        raise SchemaError(f"give 1 to {MAX_CHOICES} strings")
    if any(not isinstance(c, str) or not c for c in choices):
        raise SchemaError("every choice must be a non-empty string")
    _check_size(compact(choices))
    lark = "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in dict.fromkeys(choices))
    return _checked(lark)


def grammar_of_lark(grammar: str) -> str:
    """A lark grammar as llguidance reads it (``start`` is the output; ``%json`` embeds a
    schema). GBNF (llama.cpp's ``::=`` rules) is refused by name."""
    _check_size(grammar)
    if "::=" in grammar:
        raise SchemaError("this looks like GBNF (::= rules); give a lark grammar (rule: ...)")
    return _checked(llguidance.LLMatcher.grammar_from_lark(grammar))


def _check_size(text: str) -> None:
    if len(text.encode()) > MAX_GRAMMAR_BYTES:
        raise SchemaError(f"{len(text.encode())} bytes; at most {MAX_GRAMMAR_BYTES}")


@functools.lru_cache(maxsize=256)
def _checked(grammar: str) -> str:
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        raise SchemaError(error.strip().splitlines()[0])
    return grammar
