"""Redis clients from mlxq's URLs: a plain node, or a primary found through Sentinel.

Every ``--redis-url`` (producer, worker, gateway, :class:`producer.Client`) takes:

- ``redis://[user:password@]host:6379/0`` or ``rediss://`` (TLS): one node, as
  redis-py reads it;
- ``redis+sentinel://[user:password@]host1:26379,host2:26379/MASTER[/DB]``
  (``rediss+sentinel://``: TLS to the data nodes): the primary that the Sentinels
  name MASTER. The user and password are the data nodes'. The Sentinels' own come
  from the query (``?sentinel_username=...&sentinel_password=...``) or from
  ``MLXQ_SENTINEL_USERNAME`` / ``MLXQ_SENTINEL_PASSWORD``; ``sentinel_tls=true``
  speaks TLS to the Sentinels. ``ssl_ca_certs=PATH`` (a private CA), and
  ``ssl_certfile`` / ``ssl_keyfile`` (a client certificate) apply to every TLS
  connection, to the nodes and to the Sentinels.

With Sentinel, a client asks the Sentinels for the primary when it connects and
again after a connection fails or a node answers READONLY (a primary demoted to
replica): redis-py's ``SentinelConnectionPool``. The callers' retries on connection
errors (the worker's backoff) then carry a step across a failover.
"""

from __future__ import annotations

import os
from typing import Any
from urllib.parse import parse_qs, unquote

from redis import Redis
from redis.asyncio import Redis as AsyncRedis

SENTINEL_SCHEMES = ("redis+sentinel", "rediss+sentinel")
DEFAULT_SENTINEL_PORT = 26379
_TRUE = ("1", "true", "yes", "on")
#: Query options naming TLS files (redis-py's own keyword names).
TLS_FILES = ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile")


class SentinelURL:
    """The parts of a ``redis+sentinel://`` URL."""

    def __init__(self, url: str) -> None:
        scheme, sep, rest = url.partition("://")
        if not sep or scheme not in SENTINEL_SCHEMES:
            raise ValueError(f"not a Sentinel URL (redis+sentinel://...): {scheme or url!r}")
        self.tls = scheme.startswith("rediss")
        rest, _, query = rest.partition("?")
        netloc, _, path = rest.partition("/")
        userinfo, at, hosts = netloc.rpartition("@")
        self.username: str | None = None
        self.password: str | None = None
        if at:
            user, colon, password = userinfo.partition(":")
            self.username = unquote(user) or None
            self.password = unquote(password) if colon else None
        self.sentinels = [_host_port(h) for h in hosts.split(",") if h]
        if not self.sentinels:
            raise ValueError("a Sentinel URL needs at least one host:port")
        parts = [p for p in path.split("/") if p]
        if not parts or len(parts) > 2:
            raise ValueError("a Sentinel URL's path is /MASTER_NAME or /MASTER_NAME/DB")
        self.master = unquote(parts[0])
        try:
            self.db = int(parts[1]) if len(parts) == 2 else 0
        except ValueError:
            raise ValueError(f"a Sentinel URL's database is a number, not {parts[1]!r}") from None
        q = {k: v[-1] for k, v in parse_qs(query).items()}
        unknown = set(q) - {"sentinel_username", "sentinel_password", "sentinel_tls", *TLS_FILES}
        if unknown:
            raise ValueError(f"unknown Sentinel URL option(s): {', '.join(sorted(unknown))}")
        self.sentinel_username = q.get("sentinel_username") or os.environ.get(
            "MLXQ_SENTINEL_USERNAME"
        )
        self.sentinel_password = q.get("sentinel_password") or os.environ.get(
            "MLXQ_SENTINEL_PASSWORD"
        )
        self.sentinel_tls = q.get("sentinel_tls", "").lower() in _TRUE
        self.tls_files = {k: q[k] for k in TLS_FILES if q.get(k)}
        for name, path in self.tls_files.items():
            if not os.path.isfile(path):
                raise ValueError(f"{name}: no such file: {path!r}")

    def sentinel_kwargs(self) -> dict[str, Any]:
        out: dict[str, Any] = {"socket_timeout": 1.0, "socket_connect_timeout": 1.0}
        if self.sentinel_username:
            out["username"] = self.sentinel_username
        if self.sentinel_password:
            out["password"] = self.sentinel_password
        if self.sentinel_tls:
            out |= {"ssl": True, **self.tls_files}
        return out

    def node_kwargs(self) -> dict[str, Any]:
        out: dict[str, Any] = {"db": self.db}
        if self.username:
            out["username"] = self.username
        if self.password:
            out["password"] = self.password
        if self.tls:
            out |= {"ssl": True, **self.tls_files}
        return out


def _host_port(text: str) -> tuple[str, int]:
    host, colon, port = text.rpartition(":")
    if not colon:
        return text, DEFAULT_SENTINEL_PORT
    try:
        return host.strip("[]"), int(port)
    except ValueError:
        raise ValueError(f"bad Sentinel address {text!r} (host:port)") from None


def is_sentinel(url: str) -> bool:
    return url.partition("://")[0] in SENTINEL_SCHEMES


#: How long a chunk or a record waits for replicas (``--wait-replicas``), in ms.
WAIT_TIMEOUT_MS = 1000


def wait_for_replicas(pipe: Any, replicas: int) -> None:
    """Queue ``WAIT`` on ``pipe``: on the connection that wrote, since WAIT counts the
    writes of its own connection."""
    pipe.execute_command("WAIT", replicas, WAIT_TIMEOUT_MS)


def _following_classes() -> tuple[type, type]:
    """redis-py's Sentinel connections, made to ask the Sentinels for the primary on
    every (re)connect. redis-py 8 reconnects a dropped connection with
    ``connect_check_health``, which retries the address it had (the dead primary's)
    for the whole retry budget instead of asking again: a failover stalled until the
    retries ran out (seen here: 74 s of "connection refused", then failed jobs)."""
    from redis.connection import SSLConnection
    from redis.sentinel import SentinelManagedConnection

    class Following(SentinelManagedConnection):
        def connect_check_health(
            self, check_health: bool = True, retry_socket_connect: bool = True
        ) -> None:
            if self.is_connected:
                return
            if self.connection_pool.is_master:
                self.host, self.port = self.connection_pool.get_master_address()
            # One attempt: the caller's retry comes back here and asks again.
            super().connect_check_health(check_health=check_health, retry_socket_connect=False)

    class FollowingSSL(Following, SSLConnection):
        pass

    return Following, FollowingSSL


def _async_following_classes() -> tuple[type, type]:
    """:func:`_following_classes` for asyncio."""
    from redis.asyncio.connection import SSLConnection
    from redis.asyncio.sentinel import SentinelManagedConnection

    class Following(SentinelManagedConnection):
        async def connect_check_health(
            self, check_health: bool = True, retry_socket_connect: bool = True
        ) -> None:
            if self.is_connected:
                return
            if self.connection_pool.is_master:
                self.host, self.port = await self.connection_pool.get_master_address()
            await super().connect_check_health(
                check_health=check_health, retry_socket_connect=False
            )

    class FollowingSSL(Following, SSLConnection):
        pass

    return Following, FollowingSSL


def failover_retry(asyncio: bool = False) -> dict[str, Any]:
    """Connection options that ride out a failover: a failed command is sent again
    (to the primary the Sentinels name then) with backoff, for about 30 seconds."""
    from redis.backoff import ExponentialBackoff
    from redis.exceptions import ConnectionError, TimeoutError

    if asyncio:
        from redis.asyncio.retry import Retry as AsyncRetry

        retry: Any = AsyncRetry(ExponentialBackoff(cap=1.0, base=0.05), retries=40)
    else:
        from redis.retry import Retry

        retry = Retry(ExponentialBackoff(cap=1.0, base=0.05), retries=40)
    return {
        "retry": retry,
        "retry_on_error": [ConnectionError, TimeoutError],
        # A frozen or partitioned primary answers nothing: give up on a reply after
        # 10 s (the longest blocking call mlxq makes waits 1 s) and ask again.
        "socket_timeout": 10.0,
        "socket_keepalive": True,
    }


def redis_from_url(url: str, **kwargs: Any) -> Redis:
    """A client for ``url`` (a node, or Sentinel's primary); ``kwargs`` go to its
    connections (retry, timeouts). Through Sentinel, commands retry across a failover
    unless ``kwargs`` set their own ``retry``."""
    if not is_sentinel(url):
        return Redis.from_url(url, **kwargs)
    from redis.sentinel import Sentinel

    s = SentinelURL(url)
    sentinel = Sentinel(s.sentinels, sentinel_kwargs=s.sentinel_kwargs())
    plain, tls = _following_classes()
    options = failover_retry() | s.node_kwargs() | kwargs
    return sentinel.master_for(s.master, connection_class=tls if s.tls else plain, **options)


def async_redis_from_url(url: str, **kwargs: Any) -> AsyncRedis:
    """:func:`redis_from_url` for asyncio (the gateway)."""
    if not is_sentinel(url):
        return AsyncRedis.from_url(url, **kwargs)
    from redis.asyncio.sentinel import Sentinel

    s = SentinelURL(url)
    sentinel = Sentinel(s.sentinels, sentinel_kwargs=s.sentinel_kwargs())
    plain, tls = _async_following_classes()
    options = failover_retry(asyncio=True) | s.node_kwargs() | kwargs
    return sentinel.master_for(s.master, connection_class=tls if s.tls else plain, **options)
