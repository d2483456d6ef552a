"""Names and defaults shared by the CLIs: environment variables, the Redis URL."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import click

DEFAULT_REDIS_URL = "redis://localhost:6379/0"

ENV_REDIS_URL = "MLXQ_REDIS_URL"
ENV_QUEUE = "MLXQ_QUEUE"


def redact_url(url: str) -> str:
    """``url`` with any password replaced by ``***`` (safe to log or print): the
    userinfo's, and ``password`` / ``sentinel_password`` in the query. Works on
    ``redis+sentinel://`` URLs with several hosts too."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    rest, q, query = rest.partition("?")
    netloc, slash, path = rest.partition("/")
    userinfo, at, hosts = netloc.rpartition("@")
    if at and ":" in userinfo:
        userinfo = userinfo.split(":", 1)[0] + ":***"
    query = re.sub(r"((?:^|&)(?:sentinel_)?password=)[^&]*", r"\1***", query)
    return f"{scheme}://{userinfo}{at}{hosts}{slash}{path}{q}{query}"


def wait_replicas_option(after: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """The ``--wait-replicas`` option of the worker, ``producer submit`` and ``producer
    serve``: WAIT for N replicas ``after`` each write (``schemas.connect.WAIT_TIMEOUT_MS``)."""
    return click.option(
        "--wait-replicas",
        envvar="MLXQ_WAIT_REPLICAS",
        type=click.IntRange(0, 16),
        default=0,
        show_default=True,
        help=f"After {after}, WAIT until this many replicas have the writes (1 s at most; a "
        "shortfall is logged and counted).",
    )


def check_queue(_ctx: click.Context, param: click.Parameter, value: Any) -> Any:
    """A click callback: each queue a ``--queue`` option names is a valid queue name
    (:func:`schemas.keys.validate_queue`), or the option is refused naming it."""
    from schemas.keys import validate_queue

    try:
        for name in (value,) if isinstance(value, str) else value:
            validate_queue(name)
    except ValueError as e:
        raise click.BadParameter(str(e), param=param) from None
    return value
