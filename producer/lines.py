"""Reading a jobs file: plain chat requests or OpenAI Batch API lines, all validated first."""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from schemas import BatchInputLine, ChatRequest, describe_validation_error


@dataclass(frozen=True)
class Defaults:
    """Values applied to lines that do not set them."""

    model: str | None = None
    draft_model: str | None = None
    num_draft_tokens: int | None = None


@dataclass(frozen=True)
class ParsedLine:
    lineno: int
    custom_id: str
    request: ChatRequest
    text: str


@dataclass(frozen=True)
class LineError:
    lineno: int
    message: str
    text: str


@dataclass
class ParsedFile:
    lines: list[ParsedLine] = field(default_factory=list)
    errors: list[LineError] = field(default_factory=list)


class LineInvalid(Exception):
    """One line is wrong; the message says what."""


def apply_defaults(body: dict[str, Any], defaults: Defaults) -> dict[str, Any]:
    """``body`` with defaults filled in where the key is absent (an explicit null stays)."""
    body = dict(body)
    extra = body.get("extra_params") if isinstance(body.get("extra_params"), dict) else {}
    if defaults.model is not None and "model" not in body:
        body["model"] = defaults.model
    has_draft_key = "draft_model" in body or "draft_model" in extra
    if defaults.draft_model is not None and not has_draft_key:
        body["draft_model"] = defaults.draft_model
    draft = body.get("draft_model") or extra.get("draft_model")
    has_k = "num_draft_tokens" in body or "num_draft_tokens" in extra
    if defaults.num_draft_tokens is not None and draft and not has_k:
        body["num_draft_tokens"] = defaults.num_draft_tokens
    return body


def parse_line(text: str, lineno: int, defaults: Defaults = Defaults()) -> tuple[str, ChatRequest]:
    """Validate one line and return ``(custom_id, request)``; raise :class:`LineInvalid`."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise LineInvalid(f"not valid JSON: {e.msg} (column {e.colno})") from None
    if not isinstance(obj, dict):
        raise LineInvalid(f"expected a JSON object, got {type(obj).__name__}")
    if {"url", "method", "body"} & obj.keys():
        try:
            line = BatchInputLine.model_validate(obj)
        except ValidationError as e:
            raise LineInvalid(describe_validation_error(e)) from None
        custom_id, body, prefix = line.custom_id, line.body, "body"
    else:
        custom_id = obj.pop("custom_id", None) or f"line-{lineno}"
        if not isinstance(custom_id, str):
            raise LineInvalid("custom_id: must be a string")
        body, prefix = obj, ""
    try:
        request = ChatRequest.model_validate(apply_defaults(body, defaults))
    except ValidationError as e:
        raise LineInvalid(describe_validation_error(e, prefix)) from None
    return custom_id, request


def parse_lines(lines: Iterable[str], defaults: Defaults = Defaults()) -> ParsedFile:
    """Validate every line (blank lines are skipped); collect good lines and all errors."""
    parsed = ParsedFile()
    first_seen: dict[str, int] = {}
    for lineno, raw in enumerate(lines, start=1):
        text = raw.rstrip("\r\n")
        if not text.strip():
            continue
        try:
            custom_id, request = parse_line(text, lineno, defaults)
        except LineInvalid as e:
            parsed.errors.append(LineError(lineno, str(e), text))
            continue
        if custom_id in first_seen:
            message = (
                f"duplicate custom_id {custom_id!r} (first used on line {first_seen[custom_id]})"
            )
            parsed.errors.append(LineError(lineno, message, text))
            continue
        first_seen[custom_id] = lineno
        parsed.lines.append(ParsedLine(lineno, custom_id, request, text))
    return parsed


def parse_file(path: Path, defaults: Defaults = Defaults()) -> ParsedFile:
    """Validate every line of a JSONL jobs file."""
    with open(path, encoding="utf-8") as f:
        return parse_lines(f, defaults)
