"""Large batches: submit in bounded memory, resumable submits, O(1) cancel under concurrent takers.

Real redis-server; the "workers" of the cancel race are the real job lifecycle
(``worker.lifecycle.held``, the code every worker takes and ends jobs with) in threads,
and one test runs a real worker process on a tiny model.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
from click.testing import CliRunner
from redis import Redis

from producer import Client
from producer.batches import batch_status, cancel_batch, iter_output_lines
from producer.cli import main
from producer.jobsfile import check_file, enqueue_file
from producer.lines import Defaults
from schemas import InvalidRequestError, Metrics, ResultRecord, keys
from schemas.store import read_result
from tests.conftest import chat
from tests.test_faults import slow_job
from tests.waiting import seconds, wait_for
from worker.lifecycle.held import Lifecycle


def batch_line(i: int, content: str = "") -> dict:
    body = chat("m", content=content or f"record {i}", max_tokens=8)
    return {"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}


def write_lines(path: Path, n: int, pad: int = 0) -> Path:
    filler = "x" * pad
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps(batch_line(i, f"record {i} {filler}")) + "\n")
    return path


def invoke(*args, input=None):
    return CliRunner().invoke(main, [str(a) for a in args], input=input, catch_exceptions=False)


# -- submit in bounded memory --------------------------------------------------------------------

_LIMITED = textwrap.dedent(
    """
    import resource, sys
    limit = int(sys.argv[1])
    resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))
    sys.argv = ["producer", *sys.argv[2:]]
    from producer.cli import main
    main()
    """
)


def run_limited(limit_bytes: int, *args: str) -> subprocess.CompletedProcess[str]:
    env = os.environ | {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-c", _LIMITED, str(limit_bytes), *args],
        capture_output=True,
        text=True,
        timeout=seconds(300),
        env=env,
    )


def test_a_file_larger_than_the_memory_limit_is_submitted_completely(tmp_path, conn, redis_url):
    small = write_lines(tmp_path / "small.jsonl", 10)
    # The least data segment a small submit needs here, found by bisection (1 MiB steps).
    lo, hi = 16 << 20, 1 << 30
    while hi - lo > 1 << 20:
        mid = (lo + hi) // 2
        ok = run_limited(mid, "submit", str(small), "--redis-url", redis_url).returncode == 0
        lo, hi = (lo, mid) if ok else (mid, hi)
    conn.flushdb()
    limit = hi + (48 << 20)
    big = write_lines(tmp_path / "big.jsonl", 24_000, pad=4000)
    assert big.stat().st_size > limit - hi + (40 << 20)  # more file than the margin, by far
    r = run_limited(limit, "submit", str(big), "--redis-url", redis_url, "--batch-id", "big")
    assert r.returncode == 0, r.stderr[-2000:]
    assert conn.llen(keys.rq_queue_key("mlxq")) == 24_000
    assert conn.hget(keys.batch_key("big"), "total") == b"24000"


def test_bad_lines_at_the_start_middle_and_end_are_all_reported(tmp_path, conn, redis_url):
    n = 20_000
    lines = [json.dumps(batch_line(i)) for i in range(n)]
    lines[0] = "{not json"
    lines[n // 2] = json.dumps(batch_line(n // 2) | {"url": "/v1/audio/speech"})
    lines[n - 1] = json.dumps(batch_line(7))  # a duplicate of line 8, far away
    lines[n - 2] = "\xff\xfe"  # replaced below by bytes that are not UTF-8
    path = tmp_path / "jobs.jsonl"
    raw = ("\n".join(lines) + "\n").encode().replace("\xff\xfe".encode(), b"\xff\xfe")
    path.write_bytes(raw)
    r = invoke("submit", path, "--redis-url", redis_url)
    assert r.exit_code == 2
    errors = [e for e in r.stderr.splitlines() if e.startswith(f"{path}:")]
    assert [e.split(":")[1] for e in errors] == ["1", str(n // 2 + 1), str(n - 1), str(n)]
    assert "not valid JSON" in errors[0] and "url" in errors[1]
    assert "not UTF-8" in errors[2]
    assert "duplicate custom_id 'r7' (first used on line 8)" in errors[3]
    assert "4 invalid line(s); nothing enqueued" in r.stderr
    assert conn.dbsize() == 0


def test_skip_invalid_on_a_large_file_writes_every_reject(tmp_path, conn, redis_url):
    n = 5000
    lines = [json.dumps(batch_line(i)) for i in range(n)]
    bad = {0: "{", 2500: "[1]", n - 1: json.dumps(batch_line(3))}
    for i, text in bad.items():
        lines[i] = text
    path = tmp_path / "jobs.jsonl"
    path.write_text("\n".join(lines) + "\n")
    r = invoke("submit", path, "--redis-url", redis_url, "--skip-invalid", "--json")
    assert r.exit_code == 0, r.output
    summary = json.loads(r.stdout)
    assert (summary["submitted"], summary["invalid"]) == (n - 3, 3)
    rejected = (tmp_path / "jobs.jsonl.rejected.jsonl").read_text().splitlines()
    assert sorted(rejected) == sorted(bad.values())
    assert conn.llen(keys.rq_queue_key("mlxq")) == n - 3


def test_resubmission_after_an_interruption_adds_only_the_missing_jobs(tmp_path, conn, redis_url):
    n = 3000
    path = write_lines(tmp_path / "jobs.jsonl", n)
    checked = check_file(path, Defaults(), lambda *a: pytest.fail(f"bad line {a}"))
    seen: list[int] = []

    def interrupt(count: int) -> None:
        seen.append(count)
        if sum(seen) >= 1000:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        enqueue_file(
            conn,
            checked,
            Defaults(),
            batch_id="resume",
            queue="mlxq",
            job_timeout=60,
            result_ttl=3600,
            progress=interrupt,
        )
    partial = conn.llen(keys.rq_queue_key("mlxq"))
    assert 0 < partial < n and conn.hget(keys.batch_key("resume"), "total") == str(partial).encode()
    r = invoke("submit", path, "--redis-url", redis_url, "--batch-id", "resume", "--json")
    summary = json.loads(r.stdout)
    assert summary["submitted"] == n - partial and summary["already_present"] == partial
    queued = [j.decode() for j in conn.lrange(keys.rq_queue_key("mlxq"), 0, -1)]
    assert queued == [keys.job_id_for("resume", f"r{i}") for i in range(n)]  # once each, in order
    assert conn.hget(keys.batch_key("resume"), "total") == str(n).encode()


def test_standard_input_is_spooled_and_checked_like_a_file(tmp_path, conn, redis_url):
    good = "".join(json.dumps(batch_line(i)) + "\n" for i in range(50))
    r = invoke("submit", "-", "--redis-url", redis_url, "--batch-id", "stdin", input=good)
    assert r.exit_code == 0, r.output
    assert conn.llen(keys.rq_queue_key("mlxq")) == 50
    assert conn.hget(keys.batch_key("stdin"), "source") == b"<stdin>"
    bad = good + "{oops\n"
    r = invoke("submit", "-", "--redis-url", redis_url, "--batch-id", "stdin2", input=bad)
    assert r.exit_code == 2 and "<stdin>:51: not valid JSON" in r.stderr
    assert not conn.exists(keys.batch_key("stdin2"))
    for empty in ("", "\n\n   \n"):
        r = invoke("submit", "-", "--redis-url", redis_url, input=empty)
        assert r.exit_code == 1 and "<stdin>: no valid lines to submit" in r.output
    assert not list(Path(os.environ.get("TMPDIR", "/tmp")).glob("mlxq-stdin-*"))


def test_a_file_changed_after_checking_is_not_enqueued(tmp_path, conn):
    path = write_lines(tmp_path / "jobs.jsonl", 20)
    checked = check_file(path, Defaults(), lambda *a: None)
    with open(path, "a") as f:
        f.write('{"custom_id": "sneaky"}\n')  # would fail validation
    from producer.jobsfile import FileChangedError

    with pytest.raises(FileChangedError, match="changed after it was checked"):
        enqueue_file(
            conn, checked, Defaults(), batch_id="b", queue="mlxq", job_timeout=1, result_ttl=60
        )
    assert conn.dbsize() == 0


def test_queued_jobs_take_half_the_redis_memory_of_rq_enqueue_many(tmp_path, conn, redis_url):
    from rq import Queue
    from rq.serializers import JSONSerializer

    n = 2000
    path = write_lines(tmp_path / "jobs.jsonl", n)
    before = conn.info("memory")["used_memory"]
    assert invoke("submit", path, "--redis-url", redis_url, "--batch-id", "lean").exit_code == 0
    ours = (conn.info("memory")["used_memory"] - before) / n
    job = conn.hgetall(keys.rq_job_key(keys.job_id_for("lean", "r5")))
    lean = {b"data", b"status", b"origin", b"enqueued_at", b"timeout", b"description"}
    assert set(job) == lean | {b"model"}  # (the model: for model-affine takes)
    assert job[b"description"] == b"r5" and job[b"model"] == batch_line(5)["body"]["model"].encode()
    conn.flushdb()
    before = conn.info("memory")["used_memory"]
    queue = Queue("raw", connection=conn, serializer=JSONSerializer)
    envelopes = [
        {"job_id": f"raw-{i:020x}", "batch_id": "raw", "custom_id": f"r{i}", "submitted_at": 1.0}
        | {"result_ttl": keys.DEFAULT_RESULT_TTL, "request": batch_line(i)["body"]}
        for i in range(n)
    ]
    datas = [
        Queue.prepare_data(keys.JOB_FUNCTION, args=(e,), job_id=e["job_id"], description="raw r")
        for e in envelopes
    ]
    with conn.pipeline() as pipe:
        queue.enqueue_many(datas, pipeline=pipe)
        pipe.rpush(keys.batch_jobs_key("raw"), *[e["job_id"] for e in envelopes])
        pipe.execute()
    theirs = (conn.info("memory")["used_memory"] - before) / n
    assert ours < 0.6 * theirs, (ours, theirs)


# -- cancel ----------------------------------------------------------------------------------------


def stand_in_worker(conn: Redis, name: str, stop: threading.Event, taken: list[str]) -> None:
    """The real lifecycle's take and end, with an instant "generation"."""
    life = Lifecycle(conn, name, ["mlxq"], lease_s=30)
    life.register()
    while not stop.is_set():
        job = life.take()
        if job is None:
            time.sleep(0.001)
            continue
        taken.append(job.id)
        e = job.envelope
        error = InvalidRequestError("a stand-in's result")
        life.end(
            job,
            ResultRecord.failed(
                job.id, e.batch_id, e.custom_id, error, metrics=Metrics(worker_id=name)
            ),
        )
    life.unregister()


def test_cancel_while_workers_take_jobs_cancels_each_queued_job_exactly_once(
    tmp_path, conn, redis_url
):
    n = 6000
    client = Client(connection=conn)
    s = client.submit({f"c{i}": chat("m", content=str(i)) for i in range(n)}, batch_id="race")
    stop, taken = threading.Event(), [[], []]
    threads = [
        threading.Thread(
            target=stand_in_worker, args=(Redis.from_url(redis_url), f"t{i}", stop, taken[i])
        )
        for i in range(2)
    ]
    for t in threads:
        t.start()
    wait_for(lambda: len(taken[0]) + len(taken[1]) > 300, timeout=30, every=0.001)
    cancelled, _ = cancel_batch(conn, "race")
    wait_for(lambda: conn.llen(keys.rq_queue_key("mlxq")) == 0, timeout=30)
    stop.set()
    for t in threads:
        t.join(seconds(30))
    ran = taken[0] + taken[1]
    assert len(ran) == len(set(ran)) and 300 < len(ran) < n
    status = batch_status(conn, "race")
    assert status.finished and status.failed == len(ran) and status.cancelled == n - len(ran)
    assert cancelled + len(ran) >= n - 2  # jobs held at the moment of the flag finished
    lines = [line for line in iter_output_lines(conn, "race")]
    assert not [line for line in lines if isinstance(line, str)]  # nothing pending
    by_id = {line.custom_id: line for line in lines}
    assert len(by_id) == n
    cancelled_lines = [x for x in lines if x.error and "cancelled" in x.error.message]
    assert len(cancelled_lines) == n - len(ran)
    assert {x.response.request_id for x in cancelled_lines}.isdisjoint(ran)
    # Cancelled jobs got no record (and no slot on the done list): each job has one outcome.
    assert conn.llen(keys.batch_done_key("race")) == len(ran)
    assert all(read_result(conn, j) is None for j in s.job_ids if j not in set(ran))
    assert client.result(s.job_ids[-1]).error.code == "cancelled"
    # A cancelled batch takes no more jobs.
    more = write_lines(tmp_path / "more.jsonl", 3)
    meta = conn.hgetall(keys.batch_key("race"))
    r = invoke("submit", more, "--batch-id", "race", "--redis-url", redis_url, "--queue", "other")
    assert r.exit_code == 1 and "was cancelled" in r.output
    assert conn.hgetall(keys.batch_key("race")) == meta and not conn.exists("rq:queue:other")
    r = invoke("status", "race", "--redis-url", redis_url)
    assert f"cancelled {n - len(ran)}" in r.stdout


def test_cancel_of_a_queue_no_worker_serves_sweeps_it(conn):
    client = Client(connection=conn)
    client.submit({f"a{i}": chat("m") for i in range(5000)}, batch_id="a")
    client.submit({f"b{i}": chat("m") for i in range(10)}, batch_id="b")
    cancelled, running = cancel_batch(conn, "a")
    assert (cancelled, running) == (5000, 0)
    assert conn.llen(keys.rq_queue_key("mlxq")) == 0  # a's list, swept
    queued = [j.decode() for j in conn.lrange(keys.rq_queue_key("mlxq#b"), 0, -1)]
    assert queued == [keys.job_id_for("b", f"b{i}") for i in range(10)]  # b's jobs untouched
    hashed = conn.hgetall(keys.rq_job_key(keys.job_id_for("a", "a42")))
    assert hashed == {b"status": b"canceled", b"description": b"a42"}  # shrunk, kept for results
    assert 0 < conn.ttl(keys.rq_job_key(keys.job_id_for("a", "a42"))) <= keys.DEFAULT_RESULT_TTL
    assert batch_status(conn, "a").cancelled == 5000 and batch_status(conn, "b").queued == 10


def test_cancel_with_a_real_worker_stops_the_running_job(conn, workers, tiny):
    client = Client(connection=conn)
    jobs = {"slow": slow_job(tiny, max_tokens=8000)} | {f"q{i}": chat(tiny.slow) for i in range(6)}
    s = client.submit(jobs, batch_id="real")
    workers("--max-batch", "1", "--burst")
    wait_for(lambda: conn.hexists(keys.RUNNING, s.job_ids[0]), timeout=120)
    cancelled, running = cancel_batch(conn, "real")
    assert (cancelled, running) == (6, 1)
    wait_for(lambda: client.status("real").finished, timeout=120)
    records = client.results("real")
    assert records[0].status == "cancelled" and records[0].partial is not None
    assert 0 < records[0].partial.usage.completion_tokens < 8000  # stopped, not finished
    assert [r.error.code for r in records[1:]] == ["cancelled"] * 6
    assert [r.custom_id for r in records] == list(jobs)
