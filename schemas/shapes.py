"""Batch lines of endpoints that run as chat jobs: ``/v1/responses``, ``/v1/completions``
and Anthropic's ``/v1/messages`` (a Message Batches request, ``{custom_id, params}``).

A file's (or a Batch API batch's) line for one of these endpoints is translated to a
chat job when it is submitted (as the gateway does for its requests); what the line
asked for is kept beside the batch (``mlxq:batch:<id>:shapes``, job id -> the shape:
its endpoint and, for a response, the request's fields a response echoes), and its
output line is translated back from the job's chat.completion when it is read. The
job's own record stays a chat.completion (what any app reading result keys gets).
"""

from __future__ import annotations

from typing import Any

from schemas.anthropic import MessagesRequest
from schemas.anthropic import from_chat as message_from_chat
from schemas.anthropic import to_chat as message_to_chat
from schemas.completions import CompletionRequest
from schemas.completions import from_chat as completion_from_chat
from schemas.responses import ResponsesRequest, TranslationError, to_chat
from schemas.responses import from_chat as response_from_chat

RESPONSES_URL = "/v1/responses"
COMPLETIONS_URL = "/v1/completions"
MESSAGES_URL = "/v1/messages"
SHAPED_URLS = (RESPONSES_URL, COMPLETIONS_URL, MESSAGES_URL)


def to_chat_job(url: str, body: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The chat body a ``url`` line's ``body`` runs as, and its shape. Raises pydantic's
    ValidationError or :class:`~schemas.responses.TranslationError` naming what is wrong."""
    if url == COMPLETIONS_URL:
        legacy = CompletionRequest.model_validate(body)
        if (why := legacy.refused()) is not None:
            raise TranslationError(why)
        if legacy.stream:
            raise TranslationError("stream: a batch line is not streamed")
        return legacy.to_chat(), {"url": url}
    if url == MESSAGES_URL:
        message = MessagesRequest.model_validate(body)
        if (why := message.refused()) is not None:
            raise TranslationError(why)
        if message.stream:
            raise TranslationError("stream: a batch line is not streamed")
        return message_to_chat(message), {"url": url, "model": message.model}
    req = ResponsesRequest.model_validate(body)
    if req.previous_response_id is not None:
        raise TranslationError(
            "previous_response_id: a batch line cannot chain stored responses (the "
            "gateway's POST /v1/responses can)"
        )
    if req.stream:
        raise TranslationError("stream: a batch line is not streamed")
    echo = req.model_dump(mode="json", exclude={"input"}, exclude_none=True)
    return to_chat(req, []), {"url": url, "request": echo}


def render(shape: dict[str, Any], completion: dict[str, Any]) -> dict[str, Any]:
    """The body a shaped line's output carries, from its job's chat.completion."""
    if shape.get("url") == COMPLETIONS_URL:
        return completion_from_chat(completion)
    if shape.get("url") == MESSAGES_URL:
        message_id = "msg_" + str(completion.get("id", "")).removeprefix("chatcmpl-")
        return message_from_chat(completion, str(shape.get("model", "")), message_id)
    req = ResponsesRequest.model_validate({**shape.get("request", {}), "input": ""})
    response_id = "resp_" + str(completion.get("id", "")).removeprefix("chatcmpl-")
    return response_from_chat(completion, req, response_id, int(completion.get("created", 0)))
