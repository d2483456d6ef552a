"""Batch webhooks: events queued by the record writers, delivered signed to a real local
HTTP server, retried after a refused delivery, shown by ``producer status``."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest

from producer import Client
from producer.webhooks import Deliverer, WebhookError, check_url, set_webhook
from schemas import keys
from tests.conftest import chat, run_worker
from tests.test_producer_cli import invoke

SECRET = "whsec_" + base64.b64encode(b"0123456789abcdef0123456789abcdef").decode()


class Receiver:
    """A local HTTP server that answers each POST with the next of ``answers``."""

    def __init__(self, answers: list[int]) -> None:
        self.answers, self.got = list(answers), []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["content-length"]))
                outer.got.append(({k.lower(): v for k, v in self.headers.items()}, body))
                self.send_response(outer.answers.pop(0) if outer.answers else 200)
                self.end_headers()

            def log_message(self, *args) -> None:
                pass

        self.server = HTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}/hooks"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()


@pytest.fixture
def receiver():
    made: list[Receiver] = []

    def start(answers: list[int]) -> Receiver:
        made.append(Receiver(answers))
        return made[-1]

    yield start
    for r in made:
        r.close()


def _verified(headers: dict, body: bytes) -> dict:
    """The event, after checking its Standard Webhooks signature independently."""
    key = base64.b64decode(SECRET.removeprefix("whsec_"))
    signed = f"{headers['webhook-id']}.{headers['webhook-timestamp']}.".encode() + body
    expected = base64.b64encode(hmac.new(key, signed, hashlib.sha256).digest()).decode()
    assert headers["webhook-signature"] == f"v1,{expected}"
    return json.loads(body)


def _deliverer(conn) -> Deliverer:
    return Deliverer(conn, base64.b64decode(SECRET.removeprefix("whsec_")), allow_private=True)


def test_completed_event_is_signed_retried_after_a_refusal_and_sent_once(
    conn, redis_url, tiny, receiver
):
    hook = receiver([500, 200])
    set_webhook(conn, "team-a", hook.url, allow_private=True)
    client = Client(connection=conn)
    client.submit(
        [chat(tiny.target, f"x {i}", max_tokens=2) for i in range(3)],
        batch_id="hooked",
        tenant="team-a",
    )
    client.submit([chat(tiny.target, "y", max_tokens=2)], batch_id="quiet", tenant="team-b")
    run_worker(redis_url, max_batch=2)
    assert conn.zcard(keys.WEBHOOKS) == 1  # the hooked batch's completion, once
    d = _deliverer(conn)
    assert d.run_once() == 1
    assert len(hook.got) == 1 and conn.zcard(keys.WEBHOOKS) == 1  # refused: again later
    assert conn.zscore(keys.WEBHOOKS, conn.zrange(keys.WEBHOOKS, 0, 0)[0]) > 0
    assert d.run_once() == 0  # not due yet (5 s backoff)
    conn.zadd(keys.WEBHOOKS, {conn.zrange(keys.WEBHOOKS, 0, 0)[0]: 0})
    assert d.run_once() == 1
    assert conn.zcard(keys.WEBHOOKS) == 0 and d.run_once() == 0
    events = [_verified(h, b) for h, b in hook.got]
    assert [e["type"] for e in events] == ["batch.completed"] * 2
    assert {e["data"]["id"] for e in events} == {"hooked"}
    assert hook.got[0][0]["webhook-id"] == hook.got[1][0]["webhook-id"] == events[0]["id"]
    shown = invoke("status", "hooked", "--redis-url", redis_url).output
    assert "webhook batch.completed: failed; again in 5 s (HTTP 500)" in shown
    assert "webhook batch.completed: delivered (HTTP 200)" in shown

    # Retried and completed again: a new event (a new id); a cancel sends its own.
    conn.hset(keys.batch_key("hooked"), "retried", 1)  # as producer retry counts it
    client.submit(
        {"extra": chat(tiny.target, "z", max_tokens=2)}, batch_id="hooked", tenant="team-a"
    )
    run_worker(redis_url)
    client.submit([chat("never/run", "c")], batch_id="stopped", tenant="team-a")
    client.cancel("stopped")
    client.cancel("stopped")  # twice: one event
    assert d.run_once() == 2
    later = [_verified(h, b) for h, b in hook.got[2:]]
    assert sorted((e["type"], e["data"]["id"]) for e in later) == [
        ("batch.cancelled", "stopped"),
        ("batch.completed", "hooked"),
    ]
    assert len({e["id"] for e in events[:1] + later}) == 3


def test_hostile_webhook_urls_and_secrets_are_refused(conn, redis_url, monkeypatch):
    for url, why in (
        ("ftp://example.com/x", "http:// or https://"),
        ("http:///nohost", "http:// or https://"),
        ("https://user:pw@example.com/", "credentials"),
        ("http://127.0.0.1:9/", "private address"),
        ("http://10.1.2.3/", "private address"),
        ("http://169.254.169.254/latest", "private address"),
        ("https://example.com/" + "a" * 2100, "longer than"),
    ):
        with pytest.raises(WebhookError, match=why):
            check_url(url)
    result = invoke(
        "tenant", "set", "t", "--webhook", "http://127.0.0.1:9/", "--redis-url", redis_url
    )
    assert result.exit_code == 2 and "private address" in result.output
    assert not conn.exists(keys.TENANT_WEBHOOKS)
    monkeypatch.setenv("MLXQ_WEBHOOK_SECRET", "not base64!")
    result = invoke("webhooks", "--once", "--redis-url", redis_url)
    assert result.exit_code == 2 and "whsec_" in result.output
    conn.zadd(keys.WEBHOOKS, {"rm -rf / now": 0, "batch.completed ../x 0": 0})
    assert _deliverer(conn).run_once() == 2 and conn.zcard(keys.WEBHOOKS) == 0


def test_the_gateway_delivers_events_when_it_has_the_secret(
    conn, redis_url, tmp_path, receiver, monkeypatch
):
    from tests.test_gateway import Gateway
    from tests.waiting import wait_for

    hook = receiver([200])
    set_webhook(conn, "team-g", hook.url, allow_private=True)
    client = Client(connection=conn)
    client.submit([chat("m", "never run")], batch_id="gw-hooked", tenant="team-g")
    client.cancel("gw-hooked")
    monkeypatch.setenv("MLXQ_WEBHOOK_SECRET", SECRET)
    monkeypatch.setenv("MLXQ_WEBHOOK_ALLOW_PRIVATE", "1")
    gw = Gateway(redis_url, tmp_path)
    try:
        wait_for(lambda: hook.got, timeout=20, every=0.1)
    finally:
        gw.stop()
    event = _verified(*hook.got[0])
    assert (event["type"], event["data"]["id"]) == ("batch.cancelled", "gw-hooked")
    assert conn.zcard(keys.WEBHOOKS) == 0
