"""``response_format``: the JSON a job must produce, compiled to an llguidance grammar.

Turning a JSON schema into a grammar needs no tokenizer and no model, so producers
and the gateway refuse a schema that cannot be enforced before anything is queued,
and a worker refuses it again (a job hash may come from anywhere) with the same
message. Workers build the token mask from the grammar (``worker.engine.constrain``).

Why llguidance (``bench/grammar.py`` measures llguidance, xgrammar and outlines-core
on a 32,000-entry byte-level BPE; figures in the README): no dependencies (xgrammar
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

#: JSON whitespace between tokens: any of the four JSON whitespace characters, at most
#: 16 in a row (pretty-printing fits; a model cannot stall on whitespace forever).
WHITESPACE = r"[\x20\x0A\x0D\x09]{0,16}"

#: ``{"type": "json_object"}``: any JSON object.
ANY_OBJECT: dict[str, Any] = {"type": "object"}


class SchemaError(ValueError):
    """A schema llguidance cannot enforce; the message names what it cannot."""


def canonical(schema: Any) -> str:
    """``schema`` as compact JSON with sorted keys: the key of compiled grammars."""
    return json.dumps(schema, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def grammar_for(schema: dict[str, Any] | bool) -> str:
    """The llguidance grammar that enforces JSON ``schema``; :class:`SchemaError` if none.

    Keywords llguidance cannot enforce (``uniqueItems``, ``not``, ...) are errors,
    never ignored: the output would not be guaranteed to validate.
    """
    text = canonical(schema)
    if len(text.encode()) > MAX_SCHEMA_BYTES:
        raise SchemaError(
            f"the schema is {len(text.encode())} bytes as JSON; at most {MAX_SCHEMA_BYTES}"
        )
    return _grammar(text)


@functools.lru_cache(maxsize=256)
def _grammar(text: str) -> str:
    # Batch files repeat one schema on every line: each distinct schema compiles once.
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            text, defaults={"whitespace_pattern": WHITESPACE}
        )
    except ValueError as e:
        raise SchemaError(str(e)) from None
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        raise SchemaError(error.splitlines()[0])
    return grammar
