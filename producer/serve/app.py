"""``producer serve``: an OpenAI-compatible HTTP gateway in front of mlxq's Redis.

Routes: ``/v1/chat/completions`` (plain and streamed), ``/v1/embeddings``, ``/v1/models``,
the Batch API (``/v1/files``, ``/v1/batches``), the Responses API, legacy completions, and
Anthropic's Messages API (``/v1/messages``, ``/v1/messages/count_tokens``,
``/v1/messages/batches``). Every route needs an API key (a bearer token, or Anthropic's
``x-api-key`` header). The gateway keeps no state of its own (files, batches and jobs
live in Redis), so several can run behind one load balancer.
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Annotated, Any, TypeVar

from fastapi import FastAPI, File, Form, Query, Request, UploadFile
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ValidationError
from redis import Redis
from redis.asyncio import Redis as AsyncRedis
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from producer.batches import BatchNotFoundError
from producer.enqueue import ENQUEUE_LUA
from producer.fleet import live_workers
from producer.metrics import registry_for
from producer.retry import RetryBody, retry_batch
from producer.serve import (
    audio,
    batchapi,
    chat,
    files,
    legacy,
    messages,
    msgbatches,
    page,
    responses,
)
from producer.serve.coalesce import Coalesced
from producer.serve.notify import Notifier
from producer.serve.settings import GatewaySettings, error
from producer.submit import BatchCancelledError
from producer.webhooks import Deliverer
from schemas import ChatRequest, InvalidRequestError, describe_validation_error
from schemas.anthropic import MessagesRequest
from schemas.anthropic import TranslationError as MessagesTranslationError
from schemas.anthropic import to_chat as messages_to_chat
from schemas.audio import AUDIO_URLS, MAX_AUDIO_BYTES
from schemas.completions import CompletionRequest
from schemas.connect import async_redis_from_url, redis_from_url
from schemas.embeddings import EmbeddingRequest
from schemas.images import ImageInvalid, check_images, has_images
from schemas.request import MAX_IMAGE_BYTES
from schemas.responses import ResponsesRequest, TranslationError, to_chat

log = logging.getLogger(__name__)


class Guard:
    """Every request: a valid API key (else 401) and a body within the limit (else 413).

    Pure ASGI, so it also covers unknown routes and streams the body without buffering.
    """

    def __init__(self, app: ASGIApp, settings: GatewaySettings) -> None:
        self.app, self.settings = app, settings

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        scope.setdefault("state", {})["arrived"] = time.perf_counter()
        headers = {k.decode().lower(): v.decode("latin-1") for k, v in scope["headers"]}
        if "authorization" not in headers and "x-api-key" in headers:  # Anthropic's header
            headers["authorization"] = f"Bearer {headers['x-api-key']}"
            scope["headers"] = [
                *scope["headers"],
                (b"authorization", headers["authorization"].encode("latin-1")),
            ]
        public = page.is_public(scope["method"], scope["path"])
        anthropic = scope["path"].startswith("/v1/messages")
        if not public and not self.settings.key_ok(headers.get("authorization")):
            reply = error(
                401, "missing or invalid API key", "authentication_error", "invalid_api_key"
            )
            return await (messages.reshaped(reply) if anthropic else reply)(scope, receive, send)
        uploads = ("/v1/files", "/v1/messages/batches")  # (a message batch's requests inline)
        is_file = scope["path"].rstrip("/") in uploads and scope["method"] == "POST"
        limit = (
            self.settings.max_file_bytes + (1 << 20) if is_file else self.settings.max_body_bytes
        )
        if scope["path"] in AUDIO_URLS:  # a recording and its form fields
            limit = max(limit, MAX_AUDIO_BYTES + (1 << 20))
        length = headers.get("content-length")
        if length and length.isdigit() and int(length) > limit:
            reply = _too_large(limit)
            return await (messages.reshaped(reply) if anthropic else reply)(scope, receive, send)
        seen = 0

        async def counted() -> Any:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > limit:
                raise _BodyTooLarge
            return message

        try:
            handler = DIRECT.get(scope["path"]) if scope["method"] == "POST" else None
            if handler is not None:
                reply = await handler(Request(scope, counted), self.settings)
                return await reply(scope, counted, send)
            await self.app(scope, counted, send)
        except _BodyTooLarge:
            reply = _too_large(limit)
            await (messages.reshaped(reply) if anthropic else reply)(scope, receive, send)


class _BodyTooLarge(Exception):
    pass


def _too_large(limit: int) -> JSONResponse:
    return error(413, f"request body larger than {limit} bytes", code="request_too_large")


def create_app(settings: GatewaySettings) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        app.state.aredis = async_redis_from_url(settings.redis_url)
        app.state.redis = redis_from_url(settings.redis_url)
        app.state.metrics = registry_for(app.state.redis)
        app.state.enqueue = Coalesced(app.state.aredis, ENQUEUE_LUA, settings.wait_replicas)
        app.state.notifier = Notifier(app.state.aredis)
        app.state.enqueue.start()
        app.state.notifier.start()
        deliverer = Deliverer.from_env(app.state.redis)  # batch webhooks, if a secret is set
        hooks = asyncio.create_task(_deliver(deliverer)) if deliverer else None
        # The startup heap (FastAPI, pydantic, redis: ~65k objects) leaves the collector:
        # a full collection over it held every request in this process for ~15 ms.
        gc.collect()
        gc.freeze()
        yield
        if hooks is not None:
            hooks.cancel()
        await app.state.notifier.stop()
        await app.state.enqueue.stop()
        await app.state.aredis.aclose()
        app.state.redis.close()

    app = FastAPI(title="mlxq gateway", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.add_middleware(Guard, settings=settings)
    _errors(app)
    _chat_routes(app, settings)
    _metrics_route(app)
    _file_routes(app, settings)
    _batch_routes(app, settings)
    msgbatches.routes(app, settings)
    page.page_routes(app, settings)
    return app


async def _deliver(deliverer: Deliverer, every_s: float = 1.0) -> None:
    """Deliver due batch webhook events, forever (each gateway process; claims keep two
    from sending one event at once)."""
    while True:
        try:
            await run_in_threadpool(deliverer.run_once)
        except Exception:  # Redis away, a bug: log, and go on next second
            log.exception("webhook delivery")
        await asyncio.sleep(every_s)


def _errors(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, e: RequestValidationError) -> JSONResponse:
        first = e.errors()[0] if e.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        return error(400, f"{where}: {first.get('msg', 'invalid request')}".strip(": "))

    @app.exception_handler(HTTPException)
    async def http(request: Request, e: HTTPException) -> JSONResponse:
        codes = {404: "not_found", 405: "method_not_allowed"}
        detail = str(e.detail)
        if e.status_code in (404, 405) and detail in ("Not Found", "Method Not Allowed"):
            detail = unsupported(request.method, request.url.path)  # no such route
        return error(e.status_code, detail, code=codes.get(e.status_code))


async def _json_body(request: Request) -> dict[str, Any] | JSONResponse:
    try:
        body = json.loads(await request.body())
    except (ValueError, UnicodeDecodeError) as e:
        return error(400, f"the body is not valid JSON: {e}")
    if not isinstance(body, dict):
        return error(400, "the body must be a JSON object")
    return body


async def completions(request: Request, s: GatewaySettings) -> Response:
    """``POST /v1/chat/completions``. Called by :class:`Guard` directly, not through
    FastAPI's router and exception layers: 1.32x the requests/s with instant jobs
    (3,767 vs 2,848, medians of 3 rounds side by side on 2 cores)."""
    got = await _validated(request, ChatRequest)
    if isinstance(got, JSONResponse):
        return got
    body, req = got
    if why := await _broken_image(body):
        return why
    return await _answer(request, s, body, (req.model, req.draft_model, req.adapter), req.stream)


async def _broken_image(body: dict[str, Any]) -> JSONResponse | None:
    """The 400 for a chat body's first inline image no worker would read (None: all
    read). Checked here, at once, so nothing is queued for it; off the event loop (a
    20 MB image's base64 and CRCs take tens of milliseconds)."""
    if not has_images(body):
        return None
    try:
        await run_in_threadpool(check_images, body)
    except ImageInvalid as e:
        return error(400, str(e), code="invalid_image")
    return None


async def transcriptions(request: Request, s: GatewaySettings) -> Response:
    """``POST /v1/audio/transcriptions`` and ``/translations``: one transcription job on
    the interactive queue, answered in its ``response_format`` (``producer.serve.audio``)."""
    got = await audio.request_body(request)
    if isinstance(got, Response):
        return got
    body, req = got
    return await _answer(request, s, body, (req.model,), False, audio.Rendered(req.response_format))


async def embeddings(request: Request, s: GatewaySettings) -> Response:
    """``POST /v1/embeddings``: one embedding job on the interactive queue, like a chat
    completion that is never streamed."""
    got = await _validated(request, EmbeddingRequest)
    if isinstance(got, JSONResponse):
        return got
    body, req = got
    return await _answer(request, s, body, (req.model,), stream=False)


M = TypeVar("M", bound=BaseModel)


async def _validated(request: Request, model: type[M]) -> tuple[dict[str, Any], M] | JSONResponse:
    """The request's JSON body and its validation as ``model``, or the 400 saying why."""
    body = await _json_body(request)
    if isinstance(body, JSONResponse):
        return body
    try:
        return body, model.model_validate(body)
    except ValidationError as e:
        return error(400, describe_validation_error(e))


async def _answer(
    request: Request,
    s: GatewaySettings,
    body: dict[str, Any],
    models: tuple[str | None, ...],
    stream: bool,
    shape: responses.Shape
    | legacy.Shape
    | messages.Shape
    | messages.Count
    | audio.Rendered
    | None = None,
) -> Response:
    """Enqueue a validated request as an interactive job; answer with its record (or
    relay its stream), as ``shape`` translates them (None: as they are)."""
    for name in filter(None, models):
        if not s.model_allowed(name):
            return error(404, f"the model {name!r} does not exist", code="model_not_found")
    aredis: AsyncRedis = request.app.state.aredis
    notifier: Notifier = request.app.state.notifier
    job_id = chat.new_job_id()
    # Streams are read from the job's stream; a plain answer's record comes by notice.
    future = None if stream else notifier.expect(job_id, s.chat_timeout_s, request)
    notify = "" if stream else notifier.key
    queued = False
    try:
        request.state.submitted = time.perf_counter()  # the envelope's submitted_at
        tenant = s.tenant_of(request.headers.get("authorization"))
        queued = await chat.enqueue(request.app.state.enqueue, job_id, body, s, notify, tenant)
        request.state.enqueued = time.perf_counter()
    finally:
        if not queued:  # refused (the queue is full) or Redis failed: nothing to wait for
            notifier.forget(job_id)
    if not queued:
        reply = error(
            429, "too many chat completions queued; retry shortly", code="rate_limit_exceeded"
        )
        reply.headers["Retry-After"] = "1"
        return reply
    headers = {"x-mlxq-job-id": job_id}
    if future is not None:
        record = await chat.wait_record(aredis, notifier, future, job_id, s.chat_ttl)
        if record and record.get("metrics"):
            headers["server-timing"] = _timing(record, request.state)
        if shape is not None and record and record.get("status") == "succeeded":
            answered = await shape.answer(record["response"])
            if isinstance(answered, Response):  # (a transcription's text, srt or vtt)
                answered.headers.update(headers)
                return answered
            return JSONResponse(answered, headers=headers)
        return _record_reply(record, headers)
    first, last_id, record = await chat.first_chunks(
        aredis, job_id, request, s.chat_timeout_s, s.chat_ttl
    )
    if record is not None or not first:
        return _record_reply(record, headers)
    if first[0].get("error"):
        e = first[0]["error"]
        return error(
            _status_of(e),
            e.get("message", "failed"),
            e.get("type", "server_error"),
            e.get("code"),
        )
    relayed = (
        chat.relay(aredis, job_id, first, last_id, s.chat_ttl)
        if shape is None
        else shape.events(aredis, job_id, chat.chunks(aredis, job_id, first, last_id, s.chat_ttl))
    )
    return StreamingResponse(
        relayed,
        media_type="text/event-stream",
        headers=headers,
    )


async def create_response(request: Request, s: GatewaySettings) -> Response:
    """``POST /v1/responses``: translated into a chat job (``schemas.responses``), run
    like a chat completion, its record translated back and stored."""
    got = await _validated(request, ResponsesRequest)
    if isinstance(got, JSONResponse):
        return got
    req = got[1]
    if why := req.refused():
        return error(400, why)
    aredis: AsyncRedis = request.app.state.aredis
    past: list[dict[str, Any]] = []
    if req.previous_response_id:
        scope = _key_scope(s, request)
        found = await responses.history(aredis, req.previous_response_id, scope)
        if found is None:
            return error(
                404,
                f"previous_response_id {req.previous_response_id!r}: no such response "
                "(expired, deleted, or created with store: false)",
                code="not_found",
            )
        past = found
    try:
        chat_body = to_chat(req, past) | ({"stream": True} if req.stream else {})
    except TranslationError as e:
        return error(400, str(e))
    shape = responses.Shape(req, chat_body, aredis, s.chat_ttl, _key_tenant(s, request))
    return await _as_chat(request, s, chat_body, shape)


async def create_completion(request: Request, s: GatewaySettings) -> Response:
    """``POST /v1/completions`` (legacy): the prompt as a chat job's ``raw_prompt``."""
    got = await _validated(request, CompletionRequest)
    if isinstance(got, JSONResponse):
        return got
    req = got[1]
    if why := req.refused():
        return error(400, why)
    return await _as_chat(request, s, req.to_chat(), legacy.Shape())


async def create_message(request: Request, s: GatewaySettings) -> Response:
    """``POST /v1/messages`` (Anthropic): translated into a chat job
    (``schemas.anthropic``), answered as a ``message`` or its events, errors in
    Anthropic's shape."""
    got = await _messages_body(request, count=False)
    if isinstance(got, Response):
        return got
    req, chat_body = got
    return messages.reshaped(await _as_chat(request, s, chat_body, messages.Shape(req)))


async def count_tokens(request: Request, s: GatewaySettings) -> Response:
    """``POST /v1/messages/count_tokens``: the prompt's tokens as the model's own template
    and tokenizer count them, from a job that prefills it and makes one token."""
    got = await _messages_body(request, count=True)
    if isinstance(got, Response):
        return got
    chat_body = got[1] | {"max_tokens": 1, "temperature": 0.0}
    return messages.reshaped(await _as_chat(request, s, chat_body, messages.Count()))


async def _messages_body(
    request: Request, count: bool
) -> tuple[MessagesRequest, dict[str, Any]] | Response:
    """A Messages body validated and translated into a chat body, or the Anthropic 400
    naming what is wrong (``count``: count_tokens' body, which has no ``max_tokens``)."""
    body = await _json_body(request)
    if isinstance(body, JSONResponse):
        return messages.reshaped(body)
    if count:
        body = {k: v for k, v in body.items() if k != "stream"} | {"max_tokens": 1}
    try:
        req = MessagesRequest.model_validate(body)
    except ValidationError as e:
        return messages.error(400, describe_validation_error(e))
    if why := req.refused():
        return messages.error(400, why)
    try:
        return req, messages_to_chat(req)
    except MessagesTranslationError as e:
        return messages.error(400, str(e))


async def _as_chat(
    request: Request,
    s: GatewaySettings,
    chat_body: dict[str, Any],
    shape: responses.Shape | legacy.Shape | messages.Shape | messages.Count,
) -> Response:
    """Run a translated request as the chat job ``chat_body`` (validated here: a 400
    names what the translation could not carry), answered through ``shape``."""
    try:
        req = ChatRequest.model_validate(chat_body)
    except ValidationError as e:
        return error(400, describe_validation_error(e))
    if why := await _broken_image(chat_body):
        return why
    models = (req.model, req.draft_model, req.adapter)
    return await _answer(request, s, chat_body, models, req.stream, shape)


#: Routes :class:`Guard` answers itself (the hot paths), by path.
DIRECT: dict[str, Callable[[Request, GatewaySettings], Awaitable[Response]]] = {
    "/v1/chat/completions": completions,
    "/v1/embeddings": embeddings,
    "/v1/audio/transcriptions": transcriptions,
    "/v1/audio/translations": transcriptions,
    "/v1/responses": create_response,
    "/v1/completions": create_completion,
    "/v1/messages": create_message,
    "/v1/messages/count_tokens": count_tokens,
}


def _timing(record: dict[str, Any], state: Any) -> str:
    """A ``Server-Timing`` header. ``job``: the job's own time, from when it was in Redis
    to its worker's ``finished_at`` (its record's queue wait and run, less the enqueue
    round trip that its ``submitted_at`` stamp includes); ``gateway``: the rest of the
    request's time here (parsing, checks, enqueueing, being told of the record,
    answering); ``enqueue``: from the request's arrival to its job in Redis; ``notice``:
    from ``finished_at`` to the record in hand here (the worker's end-of-job write and
    the notice; by the two machines' wall clocks)."""
    m, now = record["metrics"], time.perf_counter()
    job_s = (m.get("queue_wait_s") or 0.0) + (m.get("total_time_s") or 0.0)
    job_s = max(0.0, job_s - (state.enqueued - state.submitted))
    notice = time.time() - float(record.get("finished_at") or 0.0)
    return (
        f"gateway;dur={(now - state.arrived - job_s) * 1000:.2f}, "
        f"job;dur={job_s * 1000:.2f}, "
        f"enqueue;dur={(state.enqueued - state.arrived) * 1000:.2f}, "
        f"notice;dur={notice * 1000:.2f}"
    )


def _metrics_route(app: FastAPI) -> None:
    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        """The fleet's Prometheus metrics (``producer.metrics``), behind the API key."""
        body = await run_in_threadpool(generate_latest, request.app.state.metrics)
        return Response(body, media_type=CONTENT_TYPE_LATEST)


def _chat_routes(app: FastAPI, s: GatewaySettings) -> None:
    @app.get("/v1/responses/{response_id}")
    async def get_response(request: Request, response_id: str) -> Response:
        scope = _key_scope(s, request)
        found = await responses.stored(request.app.state.aredis, response_id, scope)
        if found is None:
            return error(404, f"no response {response_id!r}", code="not_found")
        return JSONResponse(found)

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(request: Request, response_id: str) -> Response:
        scope = _key_scope(s, request)
        if not await responses.delete(request.app.state.aredis, response_id, scope):
            return error(404, f"no response {response_id!r}", code="not_found")
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        workers = await run_in_threadpool(live_workers, request.app.state.redis)
        names = sorted({m.name for w in workers for m in w.models if s.model_allowed(m.name)})
        return {"object": "list", "data": [_model(n) for n in names]}

    @app.get("/v1/models/{model_id:path}")
    async def model(request: Request, model_id: str) -> Response:
        workers = await run_in_threadpool(live_workers, request.app.state.redis)
        if s.model_allowed(model_id) and any(m.name == model_id for w in workers for m in w.models):
            return JSONResponse(_model(model_id))
        return error(
            404,
            f"the model {model_id!r} is not loaded by any live worker (GET /v1/models lists them)",
            code="model_not_found",
        )


def _model(name: str) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": 0, "owned_by": "mlxq"}


#: OpenAI endpoints mlxq does not serve, and what to say of them.
NOT_SERVED = {}


def unsupported(method: str, path: str) -> str:
    """The one line a request to a route the gateway does not have gets."""
    why = NOT_SERVED.get(path.rstrip("/"))
    return f"{method} {path} is not supported by mlxq" + (f" ({why})" if why else "")


_STATUS = {"model_not_found": 404, "context_length_exceeded": 400, "invalid_request": 400}


def _status_of(e: dict[str, Any]) -> int:
    return _STATUS.get(e.get("code", ""), 400 if e.get("type") == "invalid_request_error" else 500)


def _record_reply(record: dict[str, Any] | None, headers: dict[str, str]) -> Response:
    """The HTTP answer for a job's record: its chat.completion, or its error."""
    if record is None:
        return error(
            504, "no result in time; the job was cancelled unless it had started", "timeout"
        )
    if record.get("status") == "succeeded" and record.get("response") is not None:
        body = json.dumps(record["response"], separators=(",", ":")).encode()
        return Response(body, media_type="application/json", headers=headers)
    err = record.get("error") or {}
    return error(
        int(record.get("status_code") or 500),
        err.get("message", "failed"),
        err.get("type", "server_error"),
        err.get("code"),
    )


def _key_tenant(s: GatewaySettings, request: Request) -> str:
    """The tenant of the request's API key (what it uploads and creates is theirs)."""
    return s.tenant_of(request.headers.get("authorization"))


def _key_scope(s: GatewaySettings, request: Request) -> str | None:
    """Whose files and batches the request's API key reads (None: every tenant's)."""
    return s.scope_of(request.headers.get("authorization"))


def _file_routes(app: FastAPI, s: GatewaySettings) -> None:
    def _tenant(request: Request) -> str:
        return _key_tenant(s, request)

    def _scope(request: Request) -> str | None:
        return _key_scope(s, request)

    @app.post("/v1/files")
    async def upload(
        request: Request, file: Annotated[UploadFile, File()], purpose: Annotated[str, Form()]
    ) -> Response:
        if purpose not in ("batch", "vision"):
            return error(400, f"purpose {purpose!r} is not supported (only 'batch', 'vision')")
        limit = s.max_file_bytes if purpose == "batch" else min(s.max_file_bytes, MAX_IMAGE_BYTES)
        try:
            obj = await files.store_upload(
                request.app.state.aredis, file, purpose, limit, s.file_ttl, _tenant(request)
            )
        except files.TooLarge as e:
            return error(413, str(e), code="file_too_large")
        except files.NotAnImage as e:
            return error(400, str(e))
        return JSONResponse(obj)

    async def _meta(request: Request, file_id: str) -> dict[str, Any] | None:
        if (out := files.parse_output_id(file_id)) is not None:
            redis, tenant = request.app.state.redis, _scope(request)
            fn = batchapi.output_file_meta
            return await run_in_threadpool(fn, redis, out[0], out[1], tenant)
        return await _upload(request, file_id)

    async def _upload(request: Request, file_id: str) -> dict[str, Any] | None:
        """An uploaded file's metadata, if the request's key may read it."""
        return files.owned(
            await files.file_meta(request.app.state.aredis, file_id), _scope(request)
        )

    @app.get("/v1/files/{file_id}")
    async def retrieve(request: Request, file_id: str) -> Response:
        meta = await _meta(request, file_id)
        if meta is None:
            return error(404, f"no file {file_id!r}", code="file_not_found")
        return JSONResponse(files.file_object(meta))

    @app.get("/v1/files/{file_id}/content")
    async def content(request: Request, file_id: str) -> Response:
        if (out := files.parse_output_id(file_id)) is not None:
            redis, tenant = request.app.state.redis, _scope(request)
            if await run_in_threadpool(batchapi.batch_object, redis, out[0], tenant) is None:
                return error(404, f"no file {file_id!r}", code="file_not_found")
            return StreamingResponse(
                files.iter_output_file(request.app.state.redis, out[0], out[1]),
                media_type="application/jsonl",
            )
        if (meta := await _upload(request, file_id)) is None:
            return error(404, f"no file {file_id!r}", code="file_not_found")
        kind = "application/jsonl" if meta["purpose"] == "batch" else "application/octet-stream"
        return StreamingResponse(
            files.iter_upload(request.app.state.aredis, file_id), media_type=kind
        )

    @app.delete("/v1/files/{file_id}")
    async def delete(request: Request, file_id: str) -> Response:
        owner = await _upload(request, file_id)
        if owner is None or not await files.delete_upload(request.app.state.aredis, file_id):
            return error(404, f"no file {file_id!r}", code="file_not_found")
        return JSONResponse({"id": file_id, "object": "file", "deleted": True})


def _batch_routes(app: FastAPI, s: GatewaySettings) -> None:
    def _tenant(request: Request) -> str:
        return _key_tenant(s, request)

    def _scope(request: Request) -> str | None:
        return _key_scope(s, request)

    def sync(request: Request) -> Redis:
        return request.app.state.redis

    async def _run(fn: Callable[..., Any], *args: Any) -> Any:
        return await run_in_threadpool(fn, *args)

    @app.post("/v1/batches")
    async def create(request: Request) -> Response:
        body = await _json_body(request)
        if isinstance(body, JSONResponse):
            return body
        try:
            spec = batchapi.BatchCreate.model_validate(body)
        except ValidationError as e:
            return error(400, describe_validation_error(e))
        tenant = _tenant(request)
        meta = files.owned(
            await files.file_meta(request.app.state.aredis, spec.input_file_id), tenant
        )
        if meta is None:
            return error(404, f"no file {spec.input_file_id!r}", code="file_not_found")
        if meta["purpose"] != "batch":
            return error(
                400, f"file {spec.input_file_id!r} has purpose {meta['purpose']!r}, not 'batch'"
            )
        batch_id = await _run(batchapi.create, sync(request), spec, s, tenant)
        await _validate(request, batch_id, spec.input_file_id, spec.endpoint)
        return JSONResponse(await _run(batchapi.batch_object, sync(request), batch_id))

    async def _validate(request: Request, batch_id: str, file_id: str, endpoint: str) -> None:
        """Validate the batch here if no live gateway is doing it (see batchapi.claim)."""
        if await _run(batchapi.claim, sync(request), batch_id):
            job = (batchapi.validate, sync(request), batch_id, file_id, s, endpoint)
            _background(request, *job)

    @app.get("/v1/batches/{batch_id}")
    async def retrieve(request: Request, batch_id: str) -> Response:
        obj = await _run(batchapi.batch_object, sync(request), batch_id, _scope(request))
        if obj and obj["status"] == "validating":  # its gateway may have died
            await _validate(request, batch_id, obj["input_file_id"], obj["endpoint"])
        return (
            JSONResponse(obj)
            if obj
            else error(404, f"no batch {batch_id!r}", code="batch_not_found")
        )

    @app.get("/v1/batches")
    async def listing(
        request: Request, limit: Annotated[int, Query(ge=1, le=100)] = 20, after: str | None = None
    ) -> Response:
        found = await _run(batchapi.list_batches, sync(request), limit, after, _scope(request))
        return JSONResponse(found)

    @app.post("/v1/batches/{batch_id}/retry")
    async def retry(request: Request, batch_id: str) -> Response:
        """mlxq extension: run the batch's failed jobs again (``producer retry``); the body
        may name ``status_codes`` (["5xx", "429"]) and ``error_codes``."""
        body: dict[str, Any] = {}
        if await request.body():
            parsed = await _json_body(request)
            if isinstance(parsed, JSONResponse):
                return parsed
            body = parsed
        try:
            flt = RetryBody.model_validate(body).filter()
        except ValidationError as e:
            return error(400, describe_validation_error(e))
        except InvalidRequestError as e:
            return error(400, str(e))
        if await _run(batchapi.batch_object, sync(request), batch_id, _scope(request)) is None:
            return error(404, f"no batch {batch_id!r}", code="batch_not_found")
        try:
            report = await _run(retry_batch, sync(request), batch_id, flt)
        except BatchNotFoundError:
            return error(404, f"no batch {batch_id!r}", code="batch_not_found")
        except BatchCancelledError as e:
            return error(409, str(e), code=e.code)
        obj = await _run(batchapi.batch_object, sync(request), batch_id)
        return JSONResponse(obj | {"retry": report.as_dict()})

    @app.post("/v1/batches/{batch_id}/cancel")
    async def cancel(request: Request, batch_id: str) -> Response:
        if await _run(batchapi.batch_object, sync(request), batch_id, _scope(request)) is None:
            return error(404, f"no batch {batch_id!r}", code="batch_not_found")
        await _run(batchapi.cancel, sync(request), batch_id)
        return JSONResponse(await _run(batchapi.batch_object, sync(request), batch_id))


_TASKS: set[Any] = set()


def _background(request: Request, fn: Callable[..., None], *args: Any) -> None:
    """Run ``fn`` in a thread, keeping a reference to its task until it ends."""
    task = asyncio.get_running_loop().create_task(run_in_threadpool(fn, *args))
    _TASKS.add(task)
    task.add_done_callback(_TASKS.discard)


def factory() -> FastAPI:
    """The app for ``uvicorn --factory`` (``producer serve --workers N``)."""
    return create_app(GatewaySettings.from_env())
