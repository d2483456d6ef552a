"""``POST /v1/audio/transcriptions`` and ``/v1/audio/translations``: a multipart upload (as
OpenAI's SDKs send it) becomes one transcription job on the interactive queue, its
recording inline as a data URL; the answer is rendered in the ``response_format`` asked
(``schemas.audio.render``: json, verbose_json, text, srt, vtt).

The recording is checked at the door (empty, over :data:`~schemas.audio.MAX_AUDIO_BYTES`,
no known container: a 400 naming it, nothing queued); decoding it is the worker's.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import ValidationError
from starlette.datastructures import UploadFile
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from producer.serve.settings import error
from schemas import describe_validation_error
from schemas.audio import (
    MAX_AUDIO_BYTES,
    TRANSLATIONS_URL,
    AudioInvalid,
    TranscriptionRequest,
    check_audio,
    data_url,
    render,
)

#: Form fields whose values are JSON (numbers, booleans, null), not text.
_JSON_FIELDS = {
    "temperature",
    "seed",
    "time_limit_s",
    "stream",
    "compression_ratio_threshold",
    "logprob_threshold",
    "no_speech_threshold",
    "condition_on_previous_text",
}


class Rendered:
    """How a transcription job's record is answered: in its ``response_format``."""

    def __init__(self, fmt: str) -> None:
        self.fmt = fmt

    async def answer(self, response: dict[str, Any]) -> Response:
        body, media = render(response, self.fmt)
        if isinstance(body, str):
            return Response(body, media_type=media)
        return JSONResponse(body)


async def request_body(request: Request) -> tuple[dict[str, Any], TranscriptionRequest] | Response:
    """The job body of an upload and its validated request, or the 400 saying what is
    wrong with it."""
    try:
        form = await request.form(max_files=1, max_fields=64)
    except Exception as e:  # not multipart, or malformed
        return error(400, f"the body must be multipart/form-data with a file part ({e})")
    upload = form.get("file")
    if not isinstance(upload, UploadFile):
        return error(400, "file: a recording is required (a multipart file part)")
    data = await upload.read(MAX_AUDIO_BYTES + 1)
    try:
        fmt = check_audio(data, f"file ({upload.filename or 'upload'})")
    except AudioInvalid as e:
        return error(400, str(e), code="invalid_audio")
    body: dict[str, Any] = {"file": data_url(data, fmt)}
    granularities: list[str] = []
    for name, value in form.multi_items():
        if name == "file" or not isinstance(value, str):
            continue
        if name in ("timestamp_granularities[]", "timestamp_granularities"):
            granularities.append(value)
        elif name in _JSON_FIELDS:
            try:
                body[name] = json.loads(value)
            except ValueError:
                return error(400, f"{name}: {value!r} is not a number or boolean")
        else:
            body[name] = value
    if granularities:
        body["timestamp_granularities"] = granularities
    if "task" in body:
        return error(400, "task: the route says it (/v1/audio/transcriptions or /translations)")
    body["task"] = "translate" if request.url.path == TRANSLATIONS_URL else "transcribe"
    try:
        return body, TranscriptionRequest.model_validate(body)
    except ValidationError as e:
        return error(400, describe_validation_error(e))
