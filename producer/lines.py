"""Reading a jobs file: plain chat requests or OpenAI Batch API lines, all validated first."""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from schemas import BatchInputLine, ChatRequest, describe_validation_error
from schemas.audio import (
    AUDIO_URLS,
    MAX_AUDIO_BYTES,
    TRANSCRIPTIONS_URL,
    TRANSLATIONS_URL,
    AudioInvalid,
    TranscriptionRequest,
    check_audio,
    check_file,
    data_url,
    is_audio_body,
)
from schemas.embeddings import (
    CHAT_URL,
    EMBEDDINGS_URL,
    AnyRequest,
    EmbeddingRequest,
    parse_request,
)
from schemas.images import ImageInvalid, check_images
from schemas.responses import TranslationError
from schemas.shapes import MESSAGES_URL, SHAPED_URLS, to_chat_job


@dataclass(frozen=True)
class Defaults:
    """Values applied to lines that do not set them."""

    model: str | None = None
    draft_model: str | None = None
    num_draft_tokens: int | None = None
    #: A Batch API batch's endpoint: every line must be a request of it (None: any).
    endpoint: str | None = None
    #: Where an audio line's ``file`` path is read from, and must stay under (None: paths
    #: are refused: the gateway reads no local files).
    audio_root: Path | None = None


@dataclass(frozen=True)
class ParsedLine:
    lineno: int
    custom_id: str
    request: AnyRequest
    text: str
    body: dict[str, Any]
    #: A /v1/responses or /v1/completions line's shape (``schemas.shapes``), else None.
    shape: dict[str, Any] | None = None


@dataclass(frozen=True)
class LineError:
    lineno: int
    message: str
    text: str


@dataclass
class ParsedFile:
    lines: list[ParsedLine] = field(default_factory=list)
    errors: list[LineError] = field(default_factory=list)


_NO_DEFAULTS = Defaults()
_BATCH_KEYS = frozenset(("custom_id", "method", "url", "body"))

#: A line read: custom_id, request (a chat job for a shaped line), the body stored
#: (the chat body), and the line's shape (``schemas.shapes``) or None.
Line = tuple[str, AnyRequest, dict[str, Any], dict[str, Any] | None]


class LineInvalid(Exception):
    """One line is wrong; the message says what."""


def apply_defaults(body: dict[str, Any], defaults: Defaults) -> dict[str, Any]:
    """``body`` with defaults filled in where the key is absent (an explicit null stays)."""
    if defaults == _NO_DEFAULTS:
        return body
    body = dict(body)
    extra = body.get("extra_params") if isinstance(body.get("extra_params"), dict) else {}
    if defaults.model is not None and "model" not in body:
        body["model"] = defaults.model
    if "messages" not in body:
        return body  # not a chat request (embeddings): drafts mean nothing to it
    # A line that says how it speculates (``speculation``) keeps what it says.
    says = ("draft_model", "speculation")
    has_draft_key = any(k in body or k in extra for k in says)
    if defaults.draft_model is not None and not has_draft_key:
        body["draft_model"] = defaults.draft_model
    draft = body.get("draft_model") or extra.get("draft_model")
    has_k = "num_draft_tokens" in body or "num_draft_tokens" in extra
    if defaults.num_draft_tokens is not None and draft and not has_k:
        body["num_draft_tokens"] = defaults.num_draft_tokens
    return body


def parse_line(text: str, lineno: int, defaults: Defaults = Defaults()) -> Line:
    """Validate one line; return ``(custom_id, request, body, shape)``; raise
    :class:`LineInvalid`.

    ``body`` is the request's JSON object with the defaults applied (for a
    ``/v1/responses`` or ``/v1/completions`` line: the chat body it runs as, and
    ``shape`` says how its output is translated back, ``schemas.shapes``).
    """
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise LineInvalid(f"not valid JSON: {e.msg} (column {e.colno})") from None
    if not isinstance(obj, dict):
        raise LineInvalid(f"expected a JSON object, got {type(obj).__name__}")
    if {"url", "method", "body"} & obj.keys():
        (custom_id, url), body, prefix = _batch_line(obj), obj["body"], "body"
    elif obj.keys() == {"custom_id", "params"}:  # an Anthropic Message Batches request
        custom_id, url, body, prefix = obj["custom_id"], MESSAGES_URL, obj["params"], "params"
        if not isinstance(custom_id, str) or not 0 < len(custom_id) <= 512:
            raise LineInvalid("custom_id: must be a string of 1 to 512 characters")
        if not isinstance(body, dict):
            raise LineInvalid("params: must be an object (a Messages API request)")
    else:
        url = None
        custom_id = obj.pop("custom_id", None) or f"line-{lineno}"
        if not isinstance(custom_id, str):
            raise LineInvalid("custom_id: must be a string")
        body, prefix = obj, ""
    body = apply_defaults(body, defaults)
    shape = None
    try:
        if url in AUDIO_URLS or (url is None and is_audio_body(body)):
            body = audio_body(body, url, defaults.audio_root)
            check_file(body)  # not audio, empty or over the limit: refused here
        if url in SHAPED_URLS:
            body, shape = to_chat_job(url, body)
            request = parse_request(body, CHAT_URL)
        else:
            request = parse_request(body, url)
        if isinstance(request, ChatRequest):
            check_images(body)  # broken, truncated or bomb-shaped images: refused here
    except ValidationError as e:
        raise LineInvalid(describe_validation_error(e, prefix)) from None
    except (TranslationError, ImageInvalid, AudioInvalid) as e:
        raise LineInvalid(f"{prefix}.{e}" if prefix else str(e)) from None
    if defaults.endpoint is not None:
        if url is None and isinstance(request, TranscriptionRequest):
            url = TRANSLATIONS_URL if request.task == "translate" else TRANSCRIPTIONS_URL
        if url is None:
            url = EMBEDDINGS_URL if isinstance(request, EmbeddingRequest) else CHAT_URL
        if url != defaults.endpoint:
            raise LineInvalid(f"url: a {url} request in a batch for {defaults.endpoint}")
    return custom_id, request, body, shape


def audio_body(body: dict[str, Any], url: str | None, root: Path | None) -> dict[str, Any]:
    """An audio line's body as a job runs it: ``task`` from its URL, and a ``file`` path
    read (under ``root``) into a data URL. Raises :class:`AudioInvalid` naming what is wrong."""
    body = dict(body)
    if url is not None:
        task = "translate" if url == TRANSLATIONS_URL else "transcribe"
        if body.setdefault("task", task) != task:
            raise AudioInvalid(f"task: {url} runs {task!r}, not {body['task']!r}")
    file = body.get("file")
    if not isinstance(file, str) or file.startswith(("data:", "https://", "http://", "mlxq-")):
        return body  # (validated as the request's file)
    if root is None:
        raise AudioInvalid(
            "file: a path is read by `producer submit` from its jobs file's folder; here "
            "give a data:audio/...;base64 URL or an http(s) URL"
        )
    base = root.resolve()
    path = (base / file).resolve()
    if not path.is_relative_to(base):
        raise AudioInvalid(f"file: {file!r} is outside {base} (paths stay under --audio-root)")
    if not path.is_file():
        raise AudioInvalid(f"file: no file {file!r} under {base}")
    size = path.stat().st_size
    if size > MAX_AUDIO_BYTES:
        raise AudioInvalid(
            f"file: {file!r} is {size / 2**20:.1f} MB; the limit is {MAX_AUDIO_BYTES >> 20} MB"
        )
    data = path.read_bytes()
    body["file"] = data_url(data, check_audio(data, f"file: {file!r}"))
    return body


def _batch_line(obj: dict[str, Any]) -> tuple[str, str]:
    """The custom_id and url of a valid OpenAI Batch line (checked by hand on the common
    path)."""
    cid = obj.get("custom_id")
    if (
        obj.keys() == _BATCH_KEYS
        and obj["method"] == "POST"
        and obj["url"] == CHAT_URL
        and isinstance(cid, str)
        and 0 < len(cid) <= 512
        and isinstance(obj["body"], dict)
    ):
        return cid, CHAT_URL
    try:
        line = BatchInputLine.model_validate(obj)
        return line.custom_id, line.url
    except ValidationError as e:
        raise LineInvalid(describe_validation_error(e)) from None


def parse_lines(lines: Iterable[str], defaults: Defaults = Defaults()) -> ParsedFile:
    """Validate every line (blank lines are skipped); collect good lines and all errors."""
    parsed = ParsedFile()
    first_seen: dict[str, int] = {}
    for lineno, raw in enumerate(lines, start=1):
        text = raw.rstrip("\r\n")
        if not text.strip():
            continue
        try:
            custom_id, request, body, shape = parse_line(text, lineno, defaults)
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
        parsed.lines.append(ParsedLine(lineno, custom_id, request, text, body, shape))
    return parsed


def parse_file(path: Path, defaults: Defaults = Defaults()) -> ParsedFile:
    """Validate every line of a JSONL jobs file."""
    with open(path, encoding="utf-8") as f:
        return parse_lines(f, defaults)
