"""Names and defaults shared by the CLIs: environment variables, the Redis URL."""

from __future__ import annotations

from urllib.parse import urlsplit, urlunsplit

DEFAULT_REDIS_URL = "redis://localhost:6379/0"

ENV_REDIS_URL = "MLXQ_REDIS_URL"
ENV_QUEUE = "MLXQ_QUEUE"


def redact_url(url: str) -> str:
    """``url`` with any password replaced by ``***`` (safe to log or print)."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.hostname or ""
    port = f":{parts.port}" if parts.port else ""
    netloc = f"{user}:***@{host}{port}"
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))
