"""Hostile and broken job hashes against real worker processes, on every path.

Each kind is queued between good jobs, with two workers serving the queue. Nothing
hostile runs, each bad job is dead-lettered or failed exactly once (no other
worker picks it up again), and both workers go on serving good jobs.
"""

from __future__ import annotations

import json
import os
import pickle
import signal
import zlib

import pytest
from rq import Queue
from rq.serializers import JSONSerializer

from producer import Client
from schemas import keys
from schemas.store import read_result
from tests.conftest import chat
from tests.test_faults import one_result
from tests.waiting import wait_for


class Boom:
    """Unpickling this runs a shell command."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self):
        return (os.system, (self.command,))


def queue_hostile(conn, marker) -> dict[str, str]:
    """Queue one job hash of each hostile kind; their ids by kind."""
    q = Queue("mlxq", connection=conn, serializer=JSONSerializer)
    touch = f"touch {marker}"
    q.enqueue("os.system", touch, job_id="evil-function")
    pickled = zlib.compress(pickle.dumps((keys.JOB_FUNCTION, None, (Boom(touch),), {})))
    conn.hset(
        keys.rq_job_key("evil-pickle"),
        mapping={"data": pickled, "status": "queued", "origin": "mlxq"},
    )
    conn.hset(keys.rq_job_key("evil-corrupt"), mapping={"data": b"\x00\xff garbage"})
    q.enqueue(keys.JOB_FUNCTION, "not an envelope", job_id="evil-args")
    client = Client(connection=conn)
    tampered = client.submit(
        {"callback": chat("m"), "webhook": chat("m"), "invalid": chat("m")}, batch_id="evil"
    )
    cb_id, hook_id, invalid_id = tampered.job_ids
    conn.hset(keys.rq_job_key(cb_id), "success_callback_name", "os.system")
    conn.hset(keys.rq_job_key(hook_id), "webhooks", json.dumps([{"url": "http://127.0.0.1:9/"}]))
    body = {"job_id": invalid_id, "batch_id": "evil", "custom_id": "invalid", "submitted_at": 1.0}
    conn.hset(  # valid JSON in RQ's format, but the envelope has no request
        keys.rq_job_key(invalid_id),
        "data",
        zlib.compress(json.dumps([keys.JOB_FUNCTION, None, [body], {}]).encode()),
    )
    for job_id in ("evil-pickle", "evil-corrupt", "evil-ghost"):
        conn.rpush(keys.rq_queue_key("mlxq"), job_id)
    return {
        "function": "evil-function",
        "pickle": "evil-pickle",
        "corrupt": "evil-corrupt",
        "ghost": "evil-ghost",
        "args": "evil-args",
        "callback": cb_id,
        "webhook": hook_id,
        "invalid": invalid_id,
    }


@pytest.mark.parametrize("max_batch", ["1", "8"])
def test_hostile_hashes_run_nothing_and_every_worker_goes_on(
    conn, tiny, workers, tmp_path, max_batch
):
    marker = tmp_path / "pwned"
    client = Client(connection=conn)
    good = [chat(tiny.target, content=f"good {i}", max_tokens=3, temperature=0) for i in range(3)]
    first = client.submit(good, batch_id="good-first")
    evil = queue_hostile(conn, marker)
    last = client.submit(good, batch_id="good-last")
    ws = [workers("--max-batch", max_batch, "--lease-seconds", "2", name=f"h{i}") for i in (1, 2)]
    for job_id in first.job_ids + last.job_ids:
        assert one_result(conn, job_id).status == "succeeded"
    wait_for(lambda: conn.llen(keys.rq_queue_key("mlxq")) == 0 and conn.hlen(keys.RUNNING) == 0)
    from worker.lifecycle.held import Lifecycle

    probe = Lifecycle(conn, "probe", ["mlxq"], lease_s=2)  # the workers' own pass, here
    assert [probe.recover() for _ in range(3)] == [[], [], []]  # nothing comes back
    assert not marker.exists()
    dead = [json.loads(e)["job_id"] for e in conn.lrange(keys.DEAD_LETTERS, 0, -1)]
    # Dead-lettered: all but the invalid request of a known batch, which gets a record.
    refused = ("function", "pickle", "corrupt", "ghost", "args", "callback", "webhook")
    assert sorted(dead) == sorted(evil[k] for k in refused)  # each exactly once
    for kind in ("callback", "webhook"):  # mlxq jobs of a known batch: a record too
        record = read_result(conn, evil[kind])
        assert record.status == "failed" and record.error.code == "unsafe_job"
    record = read_result(conn, evil["invalid"])
    assert record.error.code == "invalid_request" and record.status_code == 400
    assert "request: Field required" in record.error.message
    done = [j.decode() for j in conn.lrange(keys.batch_done_key("evil"), 0, -1)]
    assert sorted(done) == sorted(evil[k] for k in ("callback", "webhook", "invalid"))
    for kind in ("function", "pickle", "corrupt", "args", "callback", "webhook", "invalid"):
        assert conn.hget(keys.rq_job_key(evil[kind]), "status") == b"failed", kind
    assert conn.llen(keys.rq_queue_key("mlxq")) == 0 and conn.hlen(keys.RUNNING) == 0
    assert all(w.proc.poll() is None for w in ws)
    after = client.submit([chat(tiny.target, max_tokens=2)] * 4)
    assert all(one_result(conn, j).status == "succeeded" for j in after.job_ids)
    for w in ws:
        w.signal(signal.SIGTERM)
        assert w.wait() == 0
    assert "Traceback" not in "".join(w.output for w in ws)
