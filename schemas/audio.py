"""Audio jobs: OpenAI's ``/v1/audio/transcriptions`` and ``/translations`` as job requests,
the transcription record, and the door's checks of a recording's bytes.

A job's request is a transcription when it has ``file`` (and neither ``messages`` nor
``input``). ``file`` is a recording stored once with its batch (``mlxq-audio:<sha256>``,
in the batch's media hash, ``schemas.keys.batch_images_key``), a base64 ``data:`` URL
(what the gateway's upload becomes) or an http(s) URL from a host the worker allows
(the image host rules). ``producer submit`` also reads local paths, under an allowed
root, and stores them by hash (``producer.lines``). The door refuses bytes that are no
audio container it knows (:func:`audio_format`), and files over :data:`MAX_AUDIO_BYTES`;
the worker decodes (PyAV) and refuses truncated files and recordings over
:data:`MAX_AUDIO_S` (a decompression bomb stops there too).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import math
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

TRANSCRIPTIONS_URL = "/v1/audio/transcriptions"
TRANSLATIONS_URL = "/v1/audio/translations"
AUDIO_URLS = (TRANSCRIPTIONS_URL, TRANSLATIONS_URL)
#: The largest recording a job carries (OpenAI's limit for one file).
MAX_AUDIO_BYTES = 25 * 2**20
#: The longest recording, in seconds of audio (4 hours): decoding stops there.
MAX_AUDIO_S = 4 * 3600
MAX_PROMPT_CHARS = 4096
AUDIO_REF = re.compile(r"mlxq-audio:([0-9a-f]{64})", re.ASCII)
_DATA = re.compile(r"data:(audio|video|application)/[a-z0-9.+-]{1,32};base64,", re.ASCII)


class AudioInvalid(ValueError):
    """A recording no worker would read; the message names it and why."""


class TranscriptionRequest(BaseModel):
    """An OpenAI transcription (or translation, ``task``) request, as a worker runs it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str = Field(min_length=1, max_length=512)
    file: str = Field(min_length=1)
    #: mlxq: what the route says (``/v1/audio/translations`` is ``translate``: to English).
    task: Literal["transcribe", "translate"] = "transcribe"
    language: str | None = Field(default=None, pattern=r"^[a-z]{2,3}$")
    prompt: str | None = Field(default=None, max_length=MAX_PROMPT_CHARS)
    response_format: Literal["json", "text", "srt", "verbose_json", "vtt"] = "json"
    #: 0 (the default) tries 0.0, 0.2, ... 1.0 in turn while a window's text looks
    #: repetitive or improbable (OpenAI's and mlx-whisper's rule); above 0, that alone.
    temperature: float = Field(default=0.0, ge=0.0, le=1.0)
    timestamp_granularities: list[Literal["segment", "word"]] | None = None
    stream: bool | None = None
    user: str | None = Field(default=None, max_length=512)
    #: mlxq (mlx-whisper's ``transcribe`` arguments): a window whose text compresses more
    #: than this, or whose mean log probability is lower, is tried again hotter; above the
    #: no-speech probability (and improbable) it is skipped as silence. null: no such rule.
    compression_ratio_threshold: float | None = 2.4
    logprob_threshold: float | None = -1.0
    no_speech_threshold: float | None = Field(default=0.6, ge=0.0, le=1.0)
    #: mlxq: each window's prompt is the text before it (``transcribe``'s default).
    condition_on_previous_text: bool = True
    #: mlxq: the key of sampling at a temperature above 0 (the same seed, the same text).
    seed: int | None = None
    #: mlxq: seconds the job may run once begun (as chat jobs' ``time_limit_s``).
    time_limit_s: float | None = Field(default=None, gt=0, le=7 * 24 * 3600)

    @field_validator("file")
    @classmethod
    def _file(cls, value: str) -> str:
        if AUDIO_REF.fullmatch(value) or value.startswith(("https://", "http://")):
            if len(value) > 2048 and not AUDIO_REF.fullmatch(value):
                raise ValueError("the URL is longer than 2048 characters")
            return value
        if _DATA.match(value):
            if len(value) > 64 + (MAX_AUDIO_BYTES + 2) // 3 * 4:
                raise ValueError(f"the recording is over {MAX_AUDIO_BYTES >> 20} MB")
            return value
        raise ValueError(
            "must be a recording: a data:audio/...;base64 URL, an http(s) URL or (in a "
            "jobs file) a path"
        )

    @field_validator("timestamp_granularities")
    @classmethod
    def _granularity(cls, value: list[str] | None) -> list[str] | None:
        if value and "word" in value:
            raise ValueError("word timestamps are not produced; ask for segment timestamps")
        return value

    @field_validator("stream")
    @classmethod
    def _stream(cls, value: bool | None) -> bool | None:
        if value:
            raise ValueError("transcriptions are not streamed; the record holds the whole text")
        return value


class Segment(BaseModel):
    """One timed piece of a transcription (``verbose_json``'s segments). A figure that is
    not a number (mlx-whisper's NaN when a window's tokens were all ruled out) is null."""

    id: int
    seek: int
    start: float
    end: float
    text: str
    tokens: list[int]
    temperature: float
    avg_logprob: float | None
    compression_ratio: float | None
    no_speech_prob: float | None

    @field_validator("avg_logprob", "compression_ratio", "no_speech_prob", mode="before")
    @classmethod
    def _finite(cls, value: Any) -> Any:
        return None if isinstance(value, float) and not math.isfinite(value) else value


class AudioUsage(BaseModel):
    type: Literal["duration"] = "duration"
    seconds: float


class Transcription(BaseModel):
    """A job's record of a transcription: everything every ``response_format`` needs
    (:func:`render` makes the one asked for)."""

    object: Literal["transcription"] = "transcription"
    task: Literal["transcribe", "translate"]
    language: str
    duration: float
    text: str
    segments: list[Segment]
    usage: AudioUsage
    model: str
    response_format: str = "json"


def render(t: Transcription | dict[str, Any], fmt: str | None = None) -> tuple[Any, str]:
    """The body a client asked for, and its media type: ``json`` ``{"text", "usage"}``,
    ``verbose_json`` (task, language, duration, segments), ``text``, ``srt`` or ``vtt``."""
    if isinstance(t, dict):
        t = Transcription.model_validate(t)
    fmt = fmt or t.response_format
    if fmt == "json":
        return {"text": t.text, "usage": t.usage.model_dump()}, "application/json"
    if fmt == "verbose_json":
        body = t.model_dump(mode="json", exclude={"object", "model", "response_format"})
        return body, "application/json"
    if fmt == "text":
        return t.text + "\n", "text/plain"
    cues = [s for s in t.segments if s.text.strip()]
    if fmt == "srt":
        blocks = [
            f"{i}\n{_stamp(s.start, ',')} --> {_stamp(s.end, ',')}\n{s.text.strip()}\n"
            for i, s in enumerate(cues, start=1)
        ]
        return "\n".join(blocks), "application/x-subrip"
    blocks = [f"{_stamp(s.start, '.')} --> {_stamp(s.end, '.')}\n{s.text.strip()}\n" for s in cues]
    return "WEBVTT\n\n" + "\n".join(blocks), "text/vtt"


def _stamp(seconds: float, mark: str) -> str:
    ms = round(max(0.0, seconds) * 1000)
    h, ms = divmod(ms, 3_600_000)
    m, ms = divmod(ms, 60_000)
    s, ms = divmod(ms, 1000)
    return f"{h:02d}:{m:02d}:{s:02d}{mark}{ms:03d}"


def audio_format(data: bytes) -> str | None:
    """The container a recording's first bytes name (None: none known)."""
    head = data[:16]
    if head[:4] == b"RIFF" and head[8:12] == b"WAVE":
        return "wav"
    if head[:4] == b"fLaC":
        return "flac"
    if head[:4] == b"OggS":
        return "ogg"
    if head[:3] == b"ID3" or (len(head) > 1 and head[0] == 0xFF and head[1] & 0xE0 == 0xE0):
        return "mp3"
    if head[4:8] == b"ftyp":
        return "mp4"
    if head[:4] == b"\x1a\x45\xdf\xa3":
        return "webm"
    if head[:4] in (b"FORM",) and head[8:12] in (b"AIFF", b"AIFC"):
        return "aiff"
    return None


def check_audio(data: bytes, where: str = "file") -> str:
    """The recording's format; :class:`AudioInvalid` for empty, oversized or unknown bytes."""
    if not data:
        raise AudioInvalid(f"{where}: the recording is empty")
    if len(data) > MAX_AUDIO_BYTES:
        raise AudioInvalid(
            f"{where}: the recording is {len(data) / 2**20:.1f} MB; the limit is "
            f"{MAX_AUDIO_BYTES >> 20} MB"
        )
    found = audio_format(data)
    if found is None:
        raise AudioInvalid(
            f"{where}: not a recording of a known format (WAV, FLAC, MP3, OGG, MP4/M4A, WebM, AIFF)"
        )
    return found


def data_url(data: bytes, fmt: str) -> str:
    return f"data:audio/{fmt};base64,{base64.b64encode(data).decode()}"


def decoded(url: str) -> bytes | None:
    """The bytes of a ``data:`` URL (None: not one, or its base64 does not decode)."""
    if not _DATA.match(url):
        return None
    try:
        return base64.b64decode("".join(url.partition(",")[2].split()), validate=True)
    except (binascii.Error, ValueError):
        return None


def check_file(body: dict[str, Any]) -> None:
    """The door's check of an audio body's inline recording (refs and URLs pass)."""
    url = body.get("file")
    if isinstance(url, str) and _DATA.match(url):
        data = decoded(url)
        if data is None:
            raise AudioInvalid("file: the data URL is not valid base64")
        check_audio(data)


def stored_audio(body: dict[str, Any]) -> tuple[dict[str, Any], dict[str, bytes]]:
    """``body`` with its inline recording replaced by a reference, and the bytes by SHA-256
    (stored once with the batch); other bodies come back as they are."""
    url = body.get("file")
    if "messages" in body or not isinstance(url, str) or not _DATA.match(url):
        return body, {}
    data = decoded(url)
    if data is None:
        return body, {}  # the worker names it (a 400 for this job alone)
    digest = hashlib.sha256(data).hexdigest()
    return {**body, "file": f"mlxq-audio:{digest}"}, {digest: data}


def is_audio_body(body: Any) -> bool:
    return isinstance(body, dict) and "file" in body and not {"messages", "input"} & body.keys()
