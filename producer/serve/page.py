"""The gateway's web page, ``/ui``: batches with progress, workers, queues; retry and cancel.

The page itself and its script and style carry no data, so they load without a key (a
browser cannot send a bearer token on navigation); the page asks for an API key and sends
it with every read of ``/ui/state`` (one :func:`producer.overview.overview`: bounded Redis
work whatever the queues hold) and with the Batch API's retry and cancel calls. A tenant's
key sees its tenant's batches and queues; an operator's key (``KEY *``) every tenant's.
"""

from __future__ import annotations

from functools import cache
from importlib.resources import files

from fastapi import FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse, Response

from producer.overview import overview
from producer.serve.settings import GatewaySettings

#: Path -> (file, media type) of what loads without a key.
ASSETS = {
    "/ui": ("index.html", "text/html; charset=utf-8"),
    "/ui/": ("index.html", "text/html; charset=utf-8"),
    "/ui/ui.js": ("ui.js", "text/javascript; charset=utf-8"),
    "/ui/ui.css": ("ui.css", "text/css; charset=utf-8"),
}

#: Nothing but the gateway's own files; not framed by other sites.
HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
        "img-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


def is_public(method: str, path: str) -> bool:
    """Whether the request is for one of the page's files (no key needed)."""
    return method in ("GET", "HEAD") and path in ASSETS


@cache
def _asset(name: str) -> bytes:
    return files("producer.serve.ui").joinpath(name).read_bytes()


def page_routes(app: FastAPI, settings: GatewaySettings) -> None:
    for path, (name, media) in ASSETS.items():

        async def asset(name: str = name, media: str = media) -> Response:
            return Response(_asset(name), media_type=media, headers=HEADERS)

        app.add_api_route(path, asset, methods=["GET"], include_in_schema=False)

    @app.get("/ui/state", include_in_schema=False)
    async def state(request: Request, batches: int = 20) -> Response:
        scope = settings.scope_of(request.headers.get("authorization"))
        snapshot = await run_in_threadpool(overview, request.app.state.redis, batches, scope)
        return JSONResponse(snapshot, headers={"Cache-Control": "no-store"})
