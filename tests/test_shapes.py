"""/v1/responses and /v1/completions lines in jobs files and Batch API batches: run as chat
jobs, their output lines translated back (``schemas.shapes``), on a real worker."""

from __future__ import annotations

import json

import pytest

from producer import iter_output_lines, parse_lines
from producer.jobsfile import check_file, enqueue_file
from producer.lines import Defaults
from schemas import keys
from tests.conftest import chat, run_worker
from tests.test_gateway import gateway  # noqa: F401 (a fixture)

QUESTION = "which worker ran the batch?"


def _line(cid: str, url: str, body: dict) -> dict:
    return {"custom_id": cid, "method": "POST", "url": url, "body": body}


def _lines(model: str) -> list[dict]:
    return [
        _line("chat", "/v1/chat/completions", chat(model, QUESTION, max_tokens=12, temperature=0)),
        _line(
            "resp",
            "/v1/responses",
            {"model": model, "input": QUESTION, "max_output_tokens": 12, "temperature": 0},
        ),
        _line(
            "resp-sys",
            "/v1/responses",
            {
                "model": model,
                "instructions": "Be brief.",
                "input": [{"role": "user", "content": QUESTION}],
                "max_output_tokens": 12,
                "temperature": 0,
                "metadata": {"team": "a"},
            },
        ),
        _line(
            "legacy",
            "/v1/completions",
            {"model": model, "prompt": "the queue", "max_tokens": 6, "temperature": 0},
        ),
    ]


def _submit(conn, path, batch_id: str):
    defaults = Defaults()
    errors: list = []
    checked = check_file(path, defaults, lambda *e: errors.append(e))
    assert not errors, errors
    return enqueue_file(
        conn,
        checked,
        defaults,
        batch_id=batch_id,
        queue="mlxq",
        job_timeout=600,
        result_ttl=3600,
    )


def test_responses_and_completions_lines_run_beside_chat_lines(conn, redis_url, tiny, tmp_path):
    path = tmp_path / "mixed.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in _lines(tiny.target)) + "\n")
    _submit(conn, path, "shaped")
    run_worker(redis_url)
    out = {line.custom_id: line for line in iter_output_lines(conn, "shaped")}
    chat_body = out["chat"].response.body
    assert chat_body["object"] == "chat.completion"
    text = chat_body["choices"][0]["message"]["content"]
    resp = out["resp"].response.body
    assert resp["object"] == "response" and resp["status"] in ("completed", "incomplete")
    assert resp["id"].startswith("resp_") and resp["mlxq_metrics"]["worker_id"]
    (message,) = [o for o in resp["output"] if o["type"] == "message"]
    assert message["content"][0]["text"] == text  # the same job as the chat line's
    assert resp["usage"]["output_tokens"] == chat_body["usage"]["completion_tokens"]
    sys_resp = out["resp-sys"].response.body
    assert sys_resp["instructions"] == "Be brief." and sys_resp["metadata"] == {"team": "a"}
    assert sys_resp["max_output_tokens"] == 12
    legacy = out["legacy"].response.body
    assert legacy["object"] == "text_completion" and legacy["choices"][0]["text"]
    # The records themselves stay chat.completions (what apps reading result keys get).
    job = keys.job_id_for("shaped", "resp")
    record = json.loads(conn.get(keys.result_key(job)))
    assert record["response"]["object"] == "chat.completion"
    # Reading twice gives the same ids (a download is repeatable).
    again = {x.custom_id: x for x in iter_output_lines(conn, "shaped")}
    assert again["resp"].response.body["id"] == resp["id"]


def test_the_python_client_takes_responses_and_completions_bodies(conn, redis_url, tiny):
    from producer import Client

    client = Client(connection=conn)
    bodies = {x["custom_id"]: x["body"] for x in _lines(tiny.target)}
    client.submit(
        {"r": bodies["resp"], "r2": bodies["resp-sys"]}, batch_id="py-r", endpoint="/v1/responses"
    )
    client.submit({"c": bodies["legacy"]}, batch_id="py-c", endpoint="/v1/completions")
    client.submit({"chat": bodies["chat"]}, batch_id="py-chat")
    run_worker(redis_url)
    resp = {x.custom_id: x.response.body for x in iter_output_lines(conn, "py-r")}
    assert {b["object"] for b in resp.values()} == {"response"}
    assert resp["r2"]["instructions"] == "Be brief."
    (legacy,) = [x.response.body for x in iter_output_lines(conn, "py-c")]
    assert legacy["object"] == "text_completion"
    (chat_line,) = [x.response.body for x in iter_output_lines(conn, "py-chat")]
    (message,) = [o for o in resp["r"]["output"] if o["type"] == "message"]
    assert message["content"][0]["text"] == chat_line["choices"][0]["message"]["content"]
    with pytest.raises(ValueError, match="previous_response_id"):
        client.submit(
            [{"model": "m", "input": "x", "previous_response_id": "resp_1"}],
            endpoint="/v1/responses",
        )
    with pytest.raises(ValueError, match="endpoint"):
        client.submit([bodies["chat"]], endpoint="/v1/audio/speech")


@pytest.mark.parametrize(
    ("body", "why"),
    [
        ({"input": "x", "previous_response_id": "resp_1"}, "body.previous_response_id"),
        ({"input": "x", "stream": True}, "body.stream: a batch line is not streamed"),
        ({"input": [{"type": "image", "url": "x"}]}, "body.input"),
        ({"input": "x", "tool_choice": {"type": "nope"}}, "body.tool_choice"),
        ({"input": "x", "colour": "blue"}, "colour"),
        ({"prompt": "x", "echo": True}, "body.echo"),
        ({"prompt": ["a", "b"]}, "body.prompt: give one prompt"),
        ({"prompt": "x", "stream": True}, "body.stream"),
    ],
)
def test_bad_shaped_lines_are_refused_by_line_and_name(body, why):
    url = "/v1/completions" if "prompt" in body else "/v1/responses"
    lines = [
        _line("good", "/v1/chat/completions", chat("m")),
        _line("bad", url, {"model": "m", **body}),
    ]
    parsed = parse_lines(json.dumps(x) for x in lines)
    assert [p.custom_id for p in parsed.lines] == ["good"]
    (error,) = parsed.errors
    assert error.lineno == 2 and why in error.message, error.message


def test_a_batch_for_responses_takes_only_responses_lines(tiny):
    lines = _lines(tiny.target)
    parsed = parse_lines((json.dumps(x) for x in lines), Defaults(endpoint="/v1/responses"))
    assert [p.custom_id for p in parsed.lines] == ["resp", "resp-sys"]
    assert all(p.shape and p.shape["url"] == "/v1/responses" for p in parsed.lines)
    messages = [e.message for e in parsed.errors]
    assert messages == [
        "url: a /v1/chat/completions request in a batch for /v1/responses",
        "url: a /v1/completions request in a batch for /v1/responses",
    ]


def test_a_batch_api_batch_for_responses_through_the_sdk(gateway, workers, tiny, tmp_path):  # noqa: F811
    from tests.waiting import wait_for

    gw = gateway()
    client = gw.client()
    path = tmp_path / "in.jsonl"
    lines = [x for x in _lines(tiny.target) if x["url"] == "/v1/responses"]
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    uploaded = client.files.create(file=path.open("rb"), purpose="batch")
    batch = client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/responses", completion_window="24h"
    )
    workers()
    done = wait_for(
        lambda: (b := client.batches.retrieve(batch.id)).status == "completed" and b,
        timeout=120,
        every=0.2,
    )
    assert done.endpoint == "/v1/responses" and done.request_counts.completed == 2
    output = client.files.content(done.output_file_id).content.decode().splitlines()
    bodies = {x["custom_id"]: x["response"]["body"] for x in map(json.loads, output)}
    assert {b["object"] for b in bodies.values()} == {"response"}
    assert bodies["resp-sys"]["instructions"] == "Be brief."
