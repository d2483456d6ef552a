"""Batch webhooks: OpenAI's batch events POSTed to a tenant's URL, signed as Standard
Webhooks do, delivered at least once.

Events: ``batch.completed`` (queued by the script that writes a batch's last record, so
exactly when it happens and once per completion), ``batch.cancelled``
(``producer cancel``), ``batch.failed`` (a Batch API file that did not validate) and
``batch.expired`` (the gateway's 24 h window). Each waits in ``mlxq:webhooks`` scored by
when its next attempt is due. A deliverer (every gateway process, or ``producer
webhooks``) claims due events in one script (each claim pushes the event a minute
ahead, so two deliverers do not send it at once), POSTs ``{"id", "object": "event",
"created_at", "type", "data": {"id": <batch id>}}`` with ``webhook-id``,
``webhook-timestamp`` and ``webhook-signature`` (``v1,`` + base64 HMAC-SHA256 of
``id.timestamp.body`` under the secret ``MLXQ_WEBHOOK_SECRET``, ``whsec_`` + base64), and
on a 2xx answer forgets the event; otherwise it tries again after 5 s, 30 s, 2 min,
10 min, then every 30 min, and gives up a day after the event. Every attempt is logged
on the batch (``producer status`` shows them). Targets on loopback, private or
link-local addresses are refused unless the operator allows them.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import ipaddress
import json
import logging
import os
import socket
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from urllib.parse import urlsplit

from redis import Redis

from schemas import keys

log = logging.getLogger(__name__)

ENV_SECRET = "MLXQ_WEBHOOK_SECRET"
ENV_ALLOW_PRIVATE = "MLXQ_WEBHOOK_ALLOW_PRIVATE"
BACKOFF_S = (5, 30, 120, 600, 1800)
GIVE_UP_S = 24 * 3600
CLAIM_S = 60
TIMEOUT_S = 10
LOG_KEPT = 20
EVENTS = ("batch.completed", "batch.cancelled", "batch.failed", "batch.expired")

#: Claim the due events: each is pushed CLAIM_S ahead in the same step (KEYS: the set;
#: ARGV: now, claim seconds, most).
_CLAIM = """
local due = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1], 'LIMIT', 0, tonumber(ARGV[3]))
for _, e in ipairs(due) do redis.call('ZADD', KEYS[1], tonumber(ARGV[1]) + tonumber(ARGV[2]), e) end
return due
"""


class WebhookError(ValueError):
    """A webhook URL or secret that cannot be used (the message names why)."""


def check_url(url: str, allow_private: bool = False, resolve: bool = True) -> str:
    """``url`` if it is an http(s) URL without credentials whose host is public (unless
    ``allow_private``); else raise :class:`WebhookError`."""
    if len(url) > 2048:
        raise WebhookError("webhook URL longer than 2,048 characters")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise WebhookError(f"webhook URL {url!r}: use http:// or https:// with a host")
    if parts.username or parts.password:
        raise WebhookError("webhook URL carries credentials: sign with MLXQ_WEBHOOK_SECRET")
    if allow_private or not resolve:
        return url
    try:
        infos = socket.getaddrinfo(parts.hostname, parts.port or 443, proto=socket.IPPROTO_TCP)
    except OSError as e:
        raise WebhookError(f"webhook host {parts.hostname!r} does not resolve: {e}") from None
    for info in infos:
        ip = ipaddress.ip_address(info[4][0])
        if ip.is_loopback or ip.is_private or ip.is_link_local or ip.is_reserved:
            raise WebhookError(
                f"webhook host {parts.hostname!r} is a private address ({ip}): allowed only "
                f"with {ENV_ALLOW_PRIVATE}=1"
            )
    return url


def check_secret(secret: str) -> bytes:
    """The key bytes of a Standard Webhooks secret (``whsec_`` + base64)."""
    body = secret.removeprefix("whsec_")
    try:
        key = base64.b64decode(body, validate=True)
    except ValueError:
        raise WebhookError(f"{ENV_SECRET} is not whsec_ + base64") from None
    if len(key) < 16:
        raise WebhookError(f"{ENV_SECRET} is shorter than 16 bytes")
    return key


def sign(key: bytes, msg_id: str, timestamp: int, body: bytes) -> str:
    """The ``webhook-signature`` header of Standard Webhooks."""
    content = f"{msg_id}.{timestamp}.".encode() + body
    return "v1," + base64.b64encode(hmac.new(key, content, hashlib.sha256).digest()).decode()


def set_webhook(conn: Redis, tenant: str, url: str | None, allow_private: bool) -> None:
    """Set (or clear, with an empty URL) the tenant's webhook URL."""
    keys.validate_tenant(tenant)
    if not url:
        conn.hdel(keys.TENANT_WEBHOOKS, tenant)
        return
    conn.hset(keys.TENANT_WEBHOOKS, tenant, check_url(url, allow_private))


def emit(conn: Redis, batch_id: str, event_type: str) -> bool:
    """Queue ``event_type`` for the batch if its tenant has a webhook; True if queued."""
    tenant, retried = conn.hmget(keys.batch_key(batch_id), "tenant", "retried")
    if tenant is None or not conn.hexists(keys.TENANT_WEBHOOKS, tenant):
        return False
    event = f"{event_type} {batch_id} {int(retried or 0)}"
    now = time.time()
    conn.zadd(keys.WEBHOOKS, {event: now}, nx=True)
    conn.hsetnx(keys.WEBHOOKS_SINCE, event, now)
    return True


@dataclass
class Deliverer:
    """Delivers due events (call :meth:`run_once` every second or so)."""

    conn: Redis
    key: bytes
    allow_private: bool = False
    most: int = 20

    @classmethod
    def from_env(cls, conn: Redis) -> Deliverer | None:
        """A deliverer if ``MLXQ_WEBHOOK_SECRET`` is set (None: events wait in Redis)."""
        secret = os.environ.get(ENV_SECRET)
        if not secret:
            return None
        allow = os.environ.get(ENV_ALLOW_PRIVATE, "") in ("1", "true", "yes")
        return cls(conn, check_secret(secret), allow)

    def run_once(self) -> int:
        """Deliver what is due; how many attempts were made."""
        now = time.time()
        due = self.conn.eval(_CLAIM, 1, keys.WEBHOOKS, now, CLAIM_S, self.most)
        for raw in due:
            self._attempt(raw.decode(), now)
        return len(due)

    def _attempt(self, event: str, now: float) -> None:
        parts = event.split(" ")
        if len(parts) != 3 or parts[0] not in EVENTS or not keys.is_batch_id(parts[1]):
            self.conn.zrem(keys.WEBHOOKS, event)  # not written by mlxq: dropped, said once
            log.warning("webhook queue held a foreign entry %r: dropped", event[:80])
            return None
        event_type, batch_id = parts[0], parts[1]
        msg_id = f"msg_{hashlib.sha256(event.encode()).hexdigest()[:24]}"
        since = float(self.conn.hget(keys.WEBHOOKS_SINCE, event) or now)
        tenant = self.conn.hget(keys.batch_key(batch_id), "tenant")
        url = self.conn.hget(keys.TENANT_WEBHOOKS, tenant) if tenant else None
        if url is None:
            return self._forget(event, batch_id, {"event": event_type, "result": "no webhook"})
        timestamp = int(now)
        body = json.dumps(
            {
                "id": msg_id,
                "object": "event",
                "created_at": int(since),
                "type": event_type,
                "data": {"id": batch_id},
            }
        ).encode()
        outcome: dict[str, object] = {"event": event_type, "at": now, "id": msg_id}
        try:
            check_url(url.decode(), self.allow_private)
            request = urllib.request.Request(
                url.decode(),
                data=body,
                method="POST",
                headers={
                    "content-type": "application/json",
                    "webhook-id": msg_id,
                    "webhook-timestamp": str(timestamp),
                    "webhook-signature": sign(self.key, msg_id, timestamp, body),
                    "user-agent": "mlxq-webhooks",
                },
            )
            with urllib.request.urlopen(request, timeout=TIMEOUT_S) as reply:
                status = reply.status
        except urllib.error.HTTPError as e:
            status = e.code
        except (OSError, WebhookError) as e:
            status, outcome["error"] = 0, str(e)[:200]
        outcome["status"] = status
        if 200 <= status < 300:
            return self._forget(event, batch_id, outcome | {"result": "delivered"})
        attempts = int(self.conn.hincrby(keys.WEBHOOKS_SINCE + ":attempts", event, 1))
        if now - since >= GIVE_UP_S:
            return self._forget(event, batch_id, outcome | {"result": "given up"})
        wait = BACKOFF_S[min(attempts - 1, len(BACKOFF_S) - 1)]
        self.conn.zadd(keys.WEBHOOKS, {event: now + wait})
        self._log(batch_id, outcome | {"result": f"failed; again in {wait} s"})
        log.warning(
            "webhook %s of batch %s: answered %s; again in %d s",
            event_type,
            batch_id,
            status or outcome.get("error"),
            wait,
        )

    def _forget(self, event: str, batch_id: str, outcome: dict[str, object]) -> None:
        with self.conn.pipeline() as pipe:
            pipe.zrem(keys.WEBHOOKS, event)
            pipe.hdel(keys.WEBHOOKS_SINCE, event)
            pipe.hdel(keys.WEBHOOKS_SINCE + ":attempts", event)
            pipe.execute()
        self._log(batch_id, outcome)

    def _log(self, batch_id: str, outcome: dict[str, object]) -> None:
        key = keys.webhook_log_key(batch_id)
        ttl = self.conn.ttl(keys.batch_key(batch_id))
        with self.conn.pipeline() as pipe:
            pipe.rpush(key, json.dumps(outcome))
            pipe.ltrim(key, -LOG_KEPT, -1)
            pipe.expire(key, ttl if ttl > 0 else 86400)
            pipe.execute()


def deliveries(conn: Redis, batch_id: str) -> list[dict[str, object]]:
    """The batch's webhook attempts, oldest first (at most the last 20)."""
    return [json.loads(x) for x in conn.lrange(keys.webhook_log_key(batch_id), 0, -1)]
