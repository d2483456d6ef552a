"""The OpenAI-compatible gateway, driven by the official ``openai`` SDK.

Real pieces throughout: ``producer serve`` in a subprocess, a real worker
process on tiny models, a real redis-server.
"""

from __future__ import annotations

import gc
import http.client
import json
import os
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from email.message import Message
from pathlib import Path

import openai
import pytest
from openai.types.chat import ChatCompletion
from starlette.testclient import TestClient

from producer.localredis import free_port
from producer.serve.app import create_app
from producer.serve.settings import GatewaySettings
from schemas import keys
from tests.test_faults import slow_job
from tests.waiting import seconds, wait_for

KEY = "sk-mlxq-test-key"


class Gateway:
    def __init__(self, redis_url: str, tmp: Path, *args: str, api_keys: str = KEY) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tmp / f"gateway-{self.port}.log"
        exe = str(Path(sys.executable).with_name("producer"))
        env = os.environ | {"MLXQ_API_KEYS": api_keys, "MLXQ_REDIS_URL": redis_url}
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(
                [exe, "serve", "--port", str(self.port), *args], env=env, stderr=log
            )
        wait_for(self._up, timeout=30, every=0.1)

    def _up(self) -> bool:
        try:
            return request("GET", f"{self.url}/v1/models").status > 0  # any answer: it is up
        except OSError:
            return False

    def client(self, key: str = KEY, **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=key, max_retries=0, **kw)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(seconds(10))


def auth(key: str = KEY) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


class Reply:
    def __init__(self, status: int, headers: Message, body: bytes) -> None:
        self.status, self.headers, self.body = status, headers, body

    def json(self) -> dict:
        return json.loads(self.body)


def request(
    method: str, url: str, body: bytes | dict | None = None, headers: dict | None = None
) -> Reply:
    """A raw HTTP request (no SDK), for what the SDK would not send."""
    data = json.dumps(body).encode() if isinstance(body, dict) else body
    req = urllib.request.Request(url, data=data, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=seconds(30)) as r:
            return Reply(r.status, r.headers, r.read())
    except urllib.error.HTTPError as e:
        return Reply(e.code, e.headers, e.read())


@pytest.fixture
def gateway(redis_url, tmp_path) -> Iterator[callable]:
    started: list[Gateway] = []

    def start(*args: str, api_keys: str = KEY) -> Gateway:
        g = Gateway(redis_url, tmp_path, *args, api_keys=api_keys)
        started.append(g)
        return g

    yield start
    for g in started:
        g.stop()


def messages(text: str = "hello gateway") -> list[dict]:
    return [{"role": "user", "content": text}]


def test_chat_completions_plain_streamed_and_with_a_draft(gateway, workers, tiny, conn):
    gw = gateway()
    workers()
    client = gw.client()
    plain = client.chat.completions.create(
        model=tiny.target, messages=messages(), max_tokens=12, temperature=0
    )
    assert isinstance(plain, ChatCompletion) and plain.choices[0].message.content
    assert plain.usage.completion_tokens > 0
    pieces, final = [], None
    for chunk in client.chat.completions.create(
        model=tiny.target, messages=messages(), max_tokens=12, temperature=0, stream=True
    ):
        pieces += [c.delta.content or "" for c in chunk.choices]
        final = chunk
    assert "".join(pieces) == plain.choices[0].message.content
    assert (
        final.usage is not None and final.usage.completion_tokens == plain.usage.completion_tokens
    )
    sent = time.perf_counter()
    raw = client.chat.completions.with_raw_response.create(
        model=tiny.target,
        messages=messages(),
        max_tokens=12,
        temperature=0,
        extra_body={"draft_model": tiny.draft, "num_draft_tokens": 3},
    )
    wall_ms = (time.perf_counter() - sent) * 1000
    drafted = raw.parse()
    assert drafted.choices[0].message.content == plain.choices[0].message.content
    record = json.loads(conn.get(keys.result_key(raw.headers["x-mlxq-job-id"])))
    assert record["metrics"]["draft_model"] == tiny.draft
    looked = client.chat.completions.with_raw_response.create(
        model=tiny.target,
        messages=messages(),
        max_tokens=12,
        temperature=0,
        extra_body={"speculation": {"method": "prompt_lookup", "num_tokens": 4}},
    )
    assert looked.parse().choices[0].message.content == plain.choices[0].message.content
    got = json.loads(conn.get(keys.result_key(looked.headers["x-mlxq-job-id"])))["metrics"]
    assert got["speculation_method"] == "prompt_lookup" and got["num_draft_tokens"] == 4
    # Server-Timing: the gateway's own share leaves out the job's queue wait and run.
    timing = {
        name.strip(): float(dur.split("=")[1])
        for name, dur in (part.split(";") for part in raw.headers["server-timing"].split(","))
    }
    assert set(timing) == {"gateway", "job", "enqueue", "notice"}
    m = record["metrics"]
    job_ms = (m["queue_wait_s"] + m["total_time_s"]) * 1000
    # The job's time counts from when it was in Redis: its record's, less the enqueue.
    assert job_ms - timing["enqueue"] - 0.05 <= timing["job"] <= job_ms + 0.05
    assert 0 <= timing["enqueue"] <= timing["gateway"] + 0.5  # wall and monotonic clocks
    assert 0 <= timing["gateway"] <= wall_ms - timing["job"]
    assert 0 <= timing["notice"] <= wall_ms
    # The worker publishes what it keeps warm every couple of seconds.
    wait_for(lambda: tiny.target in [m.id for m in client.models.list().data], timeout=15)
    assert client.models.retrieve(tiny.target).id == tiny.target  # any model the list has
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve(tiny.target + "-nope")
    assert e.value.body["code"] == "model_not_found" and "-nope" in e.value.body["message"]
    # Chat jobs went through the interactive queue.
    assert conn.llen(keys.rq_queue_key(keys.INTERACTIVE_QUEUE)) == 0


def test_every_route_needs_a_valid_key(gateway):
    gw = gateway()
    with pytest.raises(openai.AuthenticationError) as e:
        gw.client(key="sk-wrong").models.list()
    assert e.value.status_code == 401
    for method, path in [("GET", "/v1/models"), ("POST", "/v1/batches"), ("GET", "/nowhere")]:
        r = request(method, gw.url + path)
        assert r.status == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert KEY not in gw.log.read_text()


def test_bad_requests_get_openai_errors(gateway):
    gw = gateway()
    url = gw.url + "/v1/chat/completions"
    r = request("POST", url, b"{not json", auth())
    assert r.status == 400 and "not valid JSON" in r.json()["error"]["message"]
    r = request("POST", url, {"model": "m", "messages": messages(), "colour": "red"}, auth())
    assert r.status == 400 and "colour" in r.json()["error"]["message"]
    client = gw.client()
    with pytest.raises(openai.NotFoundError):
        client.batches.retrieve("batch_nope")
    with pytest.raises(openai.NotFoundError):
        client.files.content("file-nope")
    with pytest.raises(openai.BadRequestError):
        client.batches.create(
            input_file_id="x", endpoint="/v1/audio/speech", completion_window="24h"
        )


def test_what_mlxq_does_not_serve_is_refused_in_one_line_naming_it(gateway):
    gw = gateway()
    for method, path, expected in [
        ("POST", "/v1/audio/speech", "POST /v1/audio/speech is not supported by mlxq"),
        ("DELETE", "/v1/models", "DELETE /v1/models is not supported by mlxq"),
    ]:
        r = request(method, gw.url + path, {"model": "m", "input": "x"}, auth())
        assert r.status in (404, 405), (path, r.status)
        assert r.json()["error"]["message"].startswith(expected), (path, r.json())
    image = [
        {"type": "text", "text": "what is this?"},
        {"type": "image_url", "image_url": {"url": "ftp://example.com/a.png"}},
    ]
    with pytest.raises(openai.BadRequestError) as e:
        gw.client().chat.completions.create(
            model="m", messages=[{"role": "user", "content": image}], max_tokens=2
        )
    assert e.value.body["message"] == (
        "messages.0.content: part 1: a 'ftp' image URL is not read: give an https URL, or "
        "the image inline as data:image/<png|jpeg|webp|gif>;base64,<bytes>"
    )


def test_an_image_request_streams_the_text_of_its_completion(gateway, workers, tmp_path):
    pytest.importorskip("mlx_vlm")
    from worker.dev.tinyvlm import ensure_vlm

    from .test_vision import data_url, png

    vlm = str(ensure_vlm(tmp_path / "tiny-gemma3-vlm"))
    gw = gateway()
    workers()
    client = gw.client()
    content = [
        {"type": "image_url", "image_url": {"url": data_url(png(1)), "detail": "low"}},
        {"type": "text", "text": "describe the queue"},
    ]
    ask = {"model": vlm, "messages": [{"role": "user", "content": content}], "max_tokens": 8}
    plain = client.chat.completions.create(**ask, temperature=0)
    assert plain.choices[0].message.content and plain.usage.prompt_tokens > 4
    pieces = [
        c.delta.content or ""
        for chunk in client.chat.completions.create(**ask, temperature=0, stream=True)
        for c in chunk.choices
    ]
    assert "".join(pieces) == plain.choices[0].message.content
    response = client.responses.create(  # the Responses API's input_image: the same job
        model=vlm,
        input=[
            {
                "role": "user",
                "content": [
                    {"type": "input_image", "image_url": data_url(png(1)), "detail": "low"},
                    {"type": "input_text", "text": "describe the queue"},
                ],
            }
        ],
        max_output_tokens=8,
        temperature=0,
    )
    assert response.output_text == plain.choices[0].message.content


def test_an_uploaded_image_is_seen_by_its_own_tenant_only(gateway, workers, tmp_path):
    pytest.importorskip("mlx_vlm")
    from worker.dev.tinyvlm import ensure_vlm

    from .test_vision import data_url, png

    vlm = str(ensure_vlm(tmp_path / "tiny-gemma3-vlm"))
    gw = gateway(api_keys=f"{KEY}=team-a,sk-other=team-b")
    workers()
    a, b = gw.client(), gw.client("sk-other")
    image = png(2)
    uploaded = a.files.create(file=("a.png", image, "image/png"), purpose="vision")
    assert uploaded.purpose == "vision" and uploaded.bytes == len(image)

    def ask(client, part):
        content = [part, {"type": "text", "text": "describe the queue"}]
        return client.chat.completions.create(
            model=vlm, messages=[{"role": "user", "content": content}], max_tokens=8, temperature=0
        )

    by_file = ask(a, {"type": "file", "file": {"file_id": uploaded.id}})
    inline = ask(a, {"type": "image_url", "image_url": {"url": data_url(image)}})
    assert by_file.choices[0].message.content == inline.choices[0].message.content
    line = {  # a Batch API line naming the file: the batch's tenant reads it
        "custom_id": "img",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {
            "model": vlm,
            "max_tokens": 8,
            "temperature": 0,
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "file", "file": {"file_id": uploaded.id}},
                        {"type": "text", "text": "describe the queue"},
                    ],
                }
            ],
        },
    }
    lines = a.files.create(file=("in.jsonl", json.dumps(line).encode() + b"\n"), purpose="batch")
    batch = a.batches.create(
        input_file_id=lines.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    done = wait_for(
        lambda: (x := a.batches.retrieve(batch.id)).status == "completed" and x,
        timeout=120,
        every=0.2,
    )
    out = json.loads(a.files.content(done.output_file_id).content)
    text = out["response"]["body"]["choices"][0]["message"]["content"]
    assert text == by_file.choices[0].message.content
    # Batches, their output files and their input files are their tenant's too.
    assert batch.id in [x.id for x in a.batches.list(limit=100)]
    assert batch.id not in [x.id for x in b.batches.list(limit=100)]
    for call in (
        lambda: b.batches.retrieve(batch.id),
        lambda: b.batches.cancel(batch.id),
        lambda: b.files.retrieve(done.output_file_id),
        lambda: b.files.content(done.output_file_id),
        lambda: b.files.content(lines.id),
        lambda: b.batches.create(
            input_file_id=lines.id, endpoint="/v1/chat/completions", completion_window="24h"
        ),
    ):
        with pytest.raises(openai.NotFoundError):
            call()
    with pytest.raises(openai.BadRequestError) as e:  # another tenant's file: not found
        ask(b, {"type": "file", "file": {"file_id": uploaded.id}})
    assert f"no file {uploaded.id!r} (of this tenant)" in e.value.body["message"]
    with pytest.raises(openai.NotFoundError):
        b.files.retrieve(uploaded.id)
    with pytest.raises(openai.NotFoundError):
        b.files.delete(uploaded.id)
    assert a.files.retrieve(uploaded.id).id == uploaded.id
    with pytest.raises(openai.BadRequestError) as e:  # not an image
        a.files.create(file=("a.png", b"<svg></svg>", "image/png"), purpose="vision")
    assert "must be a PNG, JPEG, WebP or GIF" in e.value.body["message"]
    batch_file = a.files.create(file=("b.jsonl", b"{}\n", "application/jsonl"), purpose="batch")
    with pytest.raises(openai.BadRequestError) as e:  # a vision file is no chat's batch input
        ask(a, {"type": "file", "file": {"file_id": batch_file.id}})
    assert "has purpose 'batch'" in e.value.body["message"]


def test_unknown_and_disallowed_models_are_404(gateway, workers, tiny):
    gw = gateway("--allow-model", "/tmp/*", "--allow-model", str(Path(tiny.target).parent) + "/*")
    workers()
    client = gw.client()
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="elsewhere/model", messages=messages(), max_tokens=2)
    assert e.value.body["code"] == "model_not_found"
    missing = str(Path(tiny.target).parent / "no-such-model")
    for stream in (False, True):
        with pytest.raises(openai.NotFoundError) as e:
            out = client.chat.completions.create(
                model=missing, messages=messages(), max_tokens=2, stream=stream
            )
            list(out) if stream else out
        assert e.value.body["code"] == "model_not_found"


def test_a_deep_interactive_queue_answers_429_and_a_gone_client_cancels(gateway, conn, tiny):
    gw = gateway("--max-queued", "1", "--timeout", "2")
    client = gw.client()
    statuses: list[int] = []

    def first() -> None:
        try:
            client.chat.completions.create(model=tiny.target, messages=messages(), max_tokens=2)
        except openai.APIStatusError as e:
            statuses.append(e.status_code)

    waiting = threading.Thread(target=first)
    waiting.start()  # no worker: this job stays queued
    wait_for(lambda: conn.llen(keys.rq_queue_key(keys.INTERACTIVE_QUEUE)) == 1, timeout=10)
    body = {"model": tiny.target, "messages": messages(), "max_tokens": 2}
    r = request("POST", gw.url + "/v1/chat/completions", body, auth())
    assert r.status == 429 and r.headers["Retry-After"] == "1"
    waiting.join(seconds(30))
    assert statuses == [504]
    # The first one timed out before any worker took it: its job is cancelled.
    (batch,) = [k for k in conn.keys("mlxq:batch:chat_*") if k.count(b":") == 2]
    assert conn.hexists(batch, "cancelled_at") and conn.ttl(batch) > 0
    assert conn.zcard(keys.BATCHES) == 0  # chat completions are not Batch API batches


def write_batch_file(path: Path, model: str, n: int, bad: dict[int, str] | None = None) -> Path:
    lines = []
    for i in range(n):
        body = {
            "model": model,
            "messages": messages(f"item {i}"),
            "max_tokens": 6,
            "temperature": 0,
        }
        line = {"custom_id": f"item-{i}", "method": "POST", "url": "/v1/chat/completions"}
        lines.append(json.dumps(line | {"body": body}))
    for i, text in (bad or {}).items():
        lines[i] = text
    path.write_text("\n".join(lines) + "\n")
    return path


def test_the_batch_api_flow_with_the_sdk(gateway, workers, tiny, tmp_path):
    gw = gateway()
    client = gw.client()
    path = write_batch_file(tmp_path / "in.jsonl", tiny.target, 5)
    uploaded = client.files.create(file=path.open("rb"), purpose="batch")
    assert uploaded.bytes == path.stat().st_size and uploaded.purpose == "batch"
    assert client.files.content(uploaded.id).content == path.read_bytes()
    batch = client.batches.create(
        input_file_id=uploaded.id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
        metadata={"team": "evals"},
    )
    assert batch.status in ("validating", "in_progress") and batch.metadata == {"team": "evals"}
    workers()
    done = wait_for(
        lambda: (b := client.batches.retrieve(batch.id)).status == "completed" and b,
        timeout=120,
        every=0.2,
    )
    assert done.request_counts.total == 5 and done.request_counts.completed == 5
    assert done.error_file_id is None and done.completed_at is not None
    output = client.files.content(done.output_file_id).content
    meta = client.files.retrieve(done.output_file_id)
    assert (meta.bytes, meta.purpose) == (len(output), "batch_output")
    assert client.files.retrieve(done.output_file_id).bytes == len(output)  # kept on the batch
    lines = [json.loads(x) for x in output.decode().splitlines()]
    assert sorted(x["custom_id"] for x in lines) == [f"item-{i}" for i in range(5)]
    for line in lines:
        assert line["error"] is None and line["response"]["status_code"] == 200
        ChatCompletion.model_validate(line["response"]["body"])
    assert batch.id in [b.id for b in client.batches.list(limit=10)]
    assert client.files.delete(uploaded.id).deleted
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(uploaded.id)


def test_bad_lines_fail_the_batch_with_their_errors(gateway, tmp_path, tiny, conn):
    gw = gateway()
    client = gw.client()
    path = write_batch_file(tmp_path / "in.jsonl", tiny.target, 6, bad={1: "{oops", 4: "[1]"})
    batch = client.batches.create(
        input_file_id=client.files.create(file=path.open("rb"), purpose="batch").id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
    )
    failed = wait_for(
        lambda: (b := client.batches.retrieve(batch.id)).status == "failed" and b, timeout=30
    )
    assert [(e.line, "JSON" in e.message or "object" in e.message) for e in failed.errors.data] == [
        (2, True),
        (5, True),
    ]
    assert conn.llen(keys.rq_queue_key("mlxq")) == 0  # nothing enqueued


def test_oversize_upload_and_body_are_413(gateway, tmp_path):
    gw = gateway("--max-file-mb", "1", "--max-body-mb", "1")
    big = tmp_path / "big.jsonl"
    big.write_bytes(b"x" * (3 << 20))
    with pytest.raises(openai.APIStatusError) as e:
        gw.client().files.create(file=big.open("rb"), purpose="batch")
    assert e.value.status_code == 413
    # A body sent in chunks (no Content-Length) is cut off at the limit too.
    conn = http.client.HTTPConnection("127.0.0.1", gw.port, timeout=seconds(30))
    pieces = (b"x" * (256 << 10) for _ in range(8))
    conn.request("POST", "/v1/chat/completions", body=pieces, headers=auth(), encode_chunked=True)
    reply = conn.getresponse()
    assert reply.status == 413 and json.loads(reply.read())["error"]["code"] == "request_too_large"


def test_cancel_a_running_batch(gateway, workers, tiny, tmp_path, conn):
    gw = gateway()
    client = gw.client()
    path = tmp_path / "slow.jsonl"
    rows = [
        {"custom_id": f"s{i}", "method": "POST", "url": "/v1/chat/completions"}
        | {"body": slow_job(tiny) | {"messages": messages(f"slow {i}")}}
        for i in range(4)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    batch = client.batches.create(
        input_file_id=client.files.create(file=path.open("rb"), purpose="batch").id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
    )
    workers("--max-batch", "1", "--queue", "mlxq")
    wait_for(lambda: conn.hlen(keys.RUNNING) == 1, timeout=60)
    cancelling = client.batches.cancel(batch.id)
    assert cancelling.status == "cancelling"
    ended = wait_for(
        lambda: (b := client.batches.retrieve(batch.id)).status == "cancelled" and b,
        timeout=120,
        every=0.3,
    )
    assert ended.request_counts.completed == 0 and ended.request_counts.failed == 4
    errors = [json.loads(x) for x in client.files.content(ended.error_file_id).text.splitlines()]
    assert sorted(e["custom_id"] for e in errors) == ["s0", "s1", "s2", "s3"]
    assert all(e["error"]["code"] == "cancelled" for e in errors)
    # the running one stopped at its next step: what it made, cut, beside its error
    running = [e for e in errors if ((e["response"] or {}).get("body") or {}).get("mlxq_partial")]
    assert [e["custom_id"] for e in running] == ["s0"]
    assert running[0]["response"]["body"]["mlxq_partial"]["cut"] is True


def test_workers_serve_the_interactive_queue_first(workers, tiny, conn):
    from producer.fleet import live_workers

    workers(name="plain")
    workers("--model", tiny.target, name="pinned")
    listed = wait_for(lambda: len(ws := live_workers(conn)) == 2 and ws, timeout=60)
    queues = {w.name: w.queues for w in listed}
    assert queues["plain"] == [keys.INTERACTIVE_QUEUE, keys.DEFAULT_QUEUE]
    assert queues["pinned"] == [
        keys.INTERACTIVE_QUEUE,
        keys.queue_for_model(tiny.target),
        keys.DEFAULT_QUEUE,
    ]


def test_a_batch_left_validating_by_a_dead_gateway_is_taken_over(gateway, tiny, tmp_path, conn):
    from producer.serve import batchapi
    from producer.serve.settings import GatewaySettings

    gw = gateway()
    client = gw.client()
    path = write_batch_file(tmp_path / "in.jsonl", tiny.target, 7)
    file_id = client.files.create(file=path.open("rb"), purpose="batch").id
    spec = batchapi.BatchCreate(
        input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    # What a gateway that died right after creating the batch leaves: no claim, no validation.
    batch_id = batchapi.create(conn, spec, GatewaySettings())
    assert client.batches.retrieve(batch_id).status == "validating"
    ready = wait_for(
        lambda: (b := client.batches.retrieve(batch_id)).status == "in_progress" and b, timeout=30
    )
    assert ready.request_counts.total == 7
    assert conn.llen(keys.rq_queue_key("mlxq")) == 7
    assert not conn.exists(keys.batch_key(batch_id) + ":validating")


def test_batches_are_listed_newest_first_in_pages(gateway, conn):
    from producer import Client

    for i in range(5):
        body = {"model": "m", "messages": messages(f"{i}")}
        Client(connection=conn).submit([body], batch_id=f"page-{i}")
        time.sleep(0.01)  # distinct creation times
    client = gateway().client()
    first = client.batches.list(limit=2)
    assert [b.id for b in first.data] == ["page-4", "page-3"] and first.has_more
    rest = client.batches.list(limit=10, after="page-3")
    assert [b.id for b in rest.data] == ["page-2", "page-1", "page-0"] and not rest.has_more
    assert [b.id for b in client.batches.list(limit=2)] == [  # the SDK pages through
        f"page-{i}" for i in range(4, -1, -1)
    ]
    assert all(b.status == "in_progress" and b.request_counts.total == 1 for b in rest.data)


def test_each_key_sees_its_tenants_batches_and_an_operator_key_sees_all(gateway, conn):
    from producer import Client

    client = Client(connection=conn)
    for batch_id, tenant in (("of-a", "team-a"), ("of-b", "team-b"), ("of-default", "default")):
        client.submit([{"model": "m", "messages": messages("x")}], batch_id=batch_id, tenant=tenant)
        time.sleep(0.01)
    gw = gateway(api_keys=f"{KEY}=team-a,sk-other=team-b,sk-plain,sk-op=*")
    seen = {
        key: [b.id for b in gw.client(key).batches.list(limit=100)]
        for key in (KEY, "sk-other", "sk-plain", "sk-op")
    }
    assert seen == {
        KEY: ["of-a"],
        "sk-other": ["of-b"],
        "sk-plain": ["of-default"],  # a key naming no tenant is the default tenant's
        "sk-op": ["of-default", "of-b", "of-a"],
    }
    with pytest.raises(openai.NotFoundError):
        gw.client("sk-other").batches.retrieve("of-a")
    assert gw.client("sk-op").batches.retrieve("of-a").id == "of-a"

    def page(key: str) -> dict:
        reply = request("GET", f"{gw.url}/ui/state", headers=auth(key))
        assert reply.status == 200, reply.body
        return reply.json()

    state = page(KEY)
    assert [b["batch_id"] for b in state["batches"]] == ["of-a"]
    assert [q["name"] for q in state["queues"]] == ["mlxq@team-a"]
    assert state["tenant"] == "team-a"
    state = page("sk-op")
    assert [b["batch_id"] for b in state["batches"]] == ["of-default", "of-b", "of-a"]
    assert sorted(q["name"] for q in state["queues"]) == ["mlxq", "mlxq@team-a", "mlxq@team-b"]
    assert state["tenant"] is None
    # A batch whose hash expired leaves both sets when it is next listed.
    conn.delete(keys.batch_key("of-b"))
    assert [b["batch_id"] for b in page("sk-op")["batches"]] == ["of-default", "of-a"]
    assert conn.zscore(keys.BATCHES, "of-b") is None
    conn.delete(keys.batch_key("of-a"))
    assert gw.client(KEY).batches.list(limit=100).data == []
    assert conn.zcard(keys.tenant_batches_key("team-a")) == 0
    assert conn.zscore(keys.BATCHES, "of-a") is None


def raw_chat(body: dict) -> bytes:
    """A chat completion request's bytes, for a client that goes away mid-answer."""
    data = json.dumps(body).encode()
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
    ).encode()
    return head + data


def test_a_client_that_disconnects_cancels_its_unstarted_job(gateway, conn, tiny):
    import socket

    gw = gateway()
    with socket.create_connection(("127.0.0.1", gw.port)) as sock:
        sock.sendall(raw_chat({"model": tiny.target, "messages": messages(), "max_tokens": 2}))
        wait_for(lambda: conn.llen(keys.rq_queue_key(keys.INTERACTIVE_QUEUE)) == 1, timeout=10)
    # No worker: the job is still queued when its client goes away, so it is cancelled.
    batch = wait_for(
        lambda: [
            k
            for k in conn.keys("mlxq:batch:chat_*")
            if k.count(b":") == 2 and conn.hexists(k, "cancelled_at")
        ],
        timeout=10,
    )
    assert len(batch) == 1


def test_concurrent_chat_completions_batch_streamed_or_not(gateway, workers, tiny, conn):
    gw = gateway()
    client = gw.client()
    # Bad input on the streaming path is refused before anything is queued.
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(
            model=tiny.target,
            messages=messages(),
            stream=True,
            stream_options={"include_usage": "maybe"},
        )
    assert conn.llen(keys.rq_queue_key(keys.INTERACTIVE_QUEUE)) == 0

    def ask(i: int, stream: bool = False) -> tuple[str, str]:
        kw = {"model": tiny.target, "messages": messages(f"batch me {i}"), "max_tokens": 10}
        raw = client.chat.completions.with_raw_response.create(temperature=0, stream=stream, **kw)
        reply = raw.parse()
        if stream:
            text = "".join(c.choices[0].delta.content or "" for c in reply if c.choices)
        else:
            text = reply.choices[0].message.content
        return raw.headers["x-mlxq-job-id"], text

    def concurrently(stream: bool, before_worker: bool) -> dict[int, tuple[str, str]]:
        got: dict[int, tuple[str, str]] = {}
        threads = [
            threading.Thread(target=lambda i=i: got.__setitem__(i, ask(i, stream)))
            for i in range(4)
        ]
        for t in threads:
            t.start()
        if before_worker:  # all four queued before a worker exists: it takes them together
            wait_for(lambda: conn.llen(keys.rq_queue_key(keys.INTERACTIVE_QUEUE)) == 4)
            workers()
        for t in threads:
            t.join(seconds(120))
        return got

    def batch_sizes(got: dict[int, tuple[str, str]]) -> list[int]:
        records = [json.loads(conn.get(keys.result_key(job))) for job, _ in got.values()]
        return [r["metrics"]["batch_size"] for r in records]

    batched = concurrently(stream=False, before_worker=True)
    assert min(batch_sizes(batched)) >= 2, batch_sizes(batched)
    streamed = concurrently(stream=True, before_worker=False)  # (the worker is up now)
    assert max(batch_sizes(streamed)) >= 2, batch_sizes(streamed)  # streams batch too
    for i in range(4):  # batched, streamed and alone: the same greedy text
        assert streamed[i][1] == batched[i][1] == ask(i)[1], i


def test_structured_output_logprobs_and_n_through_the_sdk(gateway, workers, tiny):
    """The SDK's own types parse what the fields produce; streamed logprobs too."""
    from tests.test_structured import SCHEMA, schema_format

    gw = gateway()
    workers()
    client = gw.client()
    out = client.chat.completions.create(
        model=tiny.target,
        messages=messages(),
        max_tokens=160,
        temperature=0.7,
        seed=3,
        n=2,
        logprobs=True,
        top_logprobs=2,
        response_format=schema_format(),
    )
    assert [c.index for c in out.choices] == [0, 1]
    for choice in out.choices:
        assert choice.logprobs.content and len(choice.logprobs.content[0].top_logprobs) <= 2
        if choice.finish_reason == "stop":
            import jsonschema

            jsonschema.validate(json.loads(choice.message.content), SCHEMA)
    streamed = []
    for chunk in client.chat.completions.create(
        model=tiny.target,
        messages=messages(),
        max_tokens=10,
        temperature=0,
        logprobs=True,
        stream=True,
    ):
        for c in chunk.choices:
            streamed += [t.token for t in (c.logprobs.content if c.logprobs else None) or []]
    whole = client.chat.completions.create(
        model=tiny.target, messages=messages(), max_tokens=10, temperature=0, logprobs=True
    )
    assert streamed == [t.token for t in whole.choices[0].logprobs.content]
    with pytest.raises(openai.BadRequestError, match="uniqueItems"):
        client.chat.completions.create(
            model=tiny.target,
            messages=messages(),
            response_format=schema_format({"type": "array", "uniqueItems": True}),
        )


def test_the_gateway_leaves_its_startup_heap_out_of_collections(redis_url):
    """A full collection over the startup heap held every request for ~15 ms: once up,
    the gateway has frozen it (the collector scans only what requests make)."""
    app = create_app(GatewaySettings(redis_url=redis_url, api_keys=frozenset({KEY})))

    gc.unfreeze()
    try:
        assert gc.get_freeze_count() == 0
        with TestClient(app):  # runs the app's startup
            assert gc.get_freeze_count() > 10_000
    finally:
        gc.unfreeze()


def test_broken_images_are_a_400_at_the_door_with_nothing_queued(gateway, conn):
    """No worker runs: each answer comes at once from the gateway's own check."""
    from tests.test_imagehead import GOOD, data_url, png_declaring

    gw = gateway()
    png = GOOD["png"]()
    broken = {
        "data:image/png;base64,AAAA": "image 1 is not a PNG, JPEG, WebP or GIF image",
        data_url(png[: len(png) // 2]): "image 1 is a truncated PNG file",
        data_url(png_declaring(30_000, 30_000)): "image 1 declares 30000 x 30000 pixels",
        "data:image/png;base64,%%%": "image 1: the data URL is not valid base64",
    }
    for url, words in broken.items():
        for stream in (False, True):
            content = [
                {"type": "text", "text": "what is it?"},
                {"type": "image_url", "image_url": {"url": url}},
            ]
            body = {
                "model": "m",
                "stream": stream,
                "messages": [{"role": "user", "content": content}],
            }
            r = request("POST", f"{gw.url}/v1/chat/completions", body, auth())
            assert r.status == 400, (url[:40], r.body)
            error = r.json()["error"]
            assert error["code"] == "invalid_image", error
            assert error["message"].startswith(f"messages.0.content.1: {words}"), error
        item = {"type": "input_image", "image_url": url}
        body = {"model": "m", "input": [{"role": "user", "content": [item]}]}
        r = request("POST", f"{gw.url}/v1/responses", body, auth())
        assert r.status == 400 and words in r.json()["error"]["message"], r.body
    upload = gw.client().files.create
    with pytest.raises(openai.BadRequestError) as e:
        upload(file=("a.png", png[:-8], "image/png"), purpose="vision")
    assert "the vision file is a truncated PNG file" in e.value.body["message"]
    assert upload(file=("a.png", png, "image/png"), purpose="vision").bytes == len(png)
    queued = [k for k in conn.scan_iter("rq:queue:*")]
    assert all(conn.llen(k) == 0 for k in queued), queued
    assert not list(conn.scan_iter(keys.result_key("*")))


def test_every_route_that_takes_an_id_is_its_own_tenants(gateway, workers, tiny, tmp_path, conn):
    """Responses, files, batches (retrieve, cancel, retry: the /ui's actions): another
    tenant's key gets the 404 of a missing id, and changes nothing; an operator key reads
    all."""
    gw = gateway(api_keys="sk-a=alpha,sk-b=beta,sk-op=*")
    a, b, op = gw.client("sk-a"), gw.client("sk-b"), gw.client("sk-op")
    workers()
    m = tiny.target
    first = a.responses.create(model=m, input="hello", temperature=0, max_output_tokens=4)
    line = {"custom_id": "x", "method": "POST", "url": "/v1/chat/completions"}
    line["body"] = {"model": m, "messages": messages("x"), "max_tokens": 2}
    upload = a.files.create(file=("in.jsonl", json.dumps(line).encode() + b"\n"), purpose="batch")
    batch = a.batches.create(
        input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    calls = {
        "GET response": lambda c: c.responses.retrieve(first.id),
        "previous_response_id": lambda c: c.responses.create(
            model=m, input="and?", previous_response_id=first.id, max_output_tokens=2
        ),
        "DELETE response": lambda c: c.responses.delete(first.id),
        "GET file": lambda c: c.files.retrieve(upload.id),
        "GET file content": lambda c: c.files.content(upload.id),
        "DELETE file": lambda c: c.files.delete(upload.id),
        "GET batch": lambda c: c.batches.retrieve(batch.id),
        "cancel batch": lambda c: c.batches.cancel(batch.id),
    }
    for name, call in calls.items():
        with pytest.raises(openai.NotFoundError):
            call(b)
            pytest.fail(f"{name}: another tenant's key got an answer")
    retried = request("POST", f"{gw.url}/v1/batches/{batch.id}/retry", {}, auth("sk-b"))
    assert retried.status == 404, retried.body
    assert op.responses.retrieve(first.id).output_text == first.output_text
    assert a.responses.retrieve(first.id).output_text == first.output_text
    assert a.files.retrieve(upload.id).id == upload.id  # beta's DELETE changed nothing
    assert a.batches.retrieve(batch.id).status != "cancelled"
    second = a.responses.create(
        model=m, input="and?", previous_response_id=first.id, max_output_tokens=2
    )
    assert second.id.startswith("resp_")
    assert json.loads(conn.get(keys.response_key(first.id)))["tenant"] == "alpha"
    a.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        op.responses.retrieve(first.id)
