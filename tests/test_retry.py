"""``producer retry``: failed jobs run again by cause, through a real worker and Redis."""

from __future__ import annotations

import json
import shutil
import time

import pytest

from producer import Client
from producer.batches import batch_status
from producer.retry import RetryFilter
from schemas import GenerationError, InvalidRequestError, ResultRecord, keys
from tests.conftest import chat, run_worker
from tests.test_producer_cli import invoke

LONG = "word " * 200  # past the 64-token context of tiny.small_ctx: a 400 every time


def _mixed_batch(conn, tiny, tmp_path, batch_id: str) -> tuple[Client, dict[str, str], str]:
    """Jobs of three kinds: on a model directory not synced yet (fails, then can run), over
    a small context (fails the same way each time), plain (succeeds)."""
    later = str(tmp_path / "not-synced-yet")
    jobs = {
        **{f"late-{i}": chat(later, f"late {i}", max_tokens=3) for i in range(3)},
        **{f"long-{i}": chat(tiny.small_ctx, LONG, max_tokens=3) for i in range(2)},
        **{f"ok-{i}": chat(tiny.target, f"ok {i}", max_tokens=3) for i in range(2)},
    }
    client = Client(connection=conn)
    s = client.submit(jobs, batch_id=batch_id)
    ids = dict(zip(jobs, s.job_ids, strict=True))
    return client, ids, later


def _raw(conn, ids: dict[str, str]) -> dict[str, bytes]:
    return {cid: conn.get(keys.result_key(j)) for cid, j in ids.items()}


def _code(raw: bytes) -> str:
    record = ResultRecord.model_validate_json(raw)
    return record.error.code if record.error else ""


def _announced(conn, batch_id: str) -> list[str]:
    return [j.decode() for j in conn.lrange(keys.batch_done_key(batch_id), 0, -1)]


def test_retry_by_cause_reruns_only_those_and_replaces_their_records(
    conn, redis_url, tiny, tmp_path
):
    client, ids, later = _mixed_batch(conn, tiny, tmp_path, "retry-cause")
    run_worker(redis_url)
    before = _raw(conn, ids)
    late_code = _code(before["late-0"])
    assert _code(before["long-0"]) == "context_length_exceeded"
    assert late_code != "context_length_exceeded"
    s = batch_status(conn, "retry-cause")
    assert (s.succeeded, s.failed, s.finished) == (2, 5, True)

    shutil.copytree(tiny.target, later)  # the directory arrives
    report = client.retry("retry-cause", error_codes=(late_code,))
    assert (report.queued, report.unmatched, report.pending) == (3, 2, 0)
    again = client.retry("retry-cause", error_codes=(late_code,))  # sent twice
    assert (again.queued, again.pending) == (0, 3)
    s = batch_status(conn, "retry-cause")
    assert (s.succeeded, s.failed, s.queued, s.finished) == (2, 2, 3, False)
    assert _raw(conn, ids) == before  # the old records stay until the new runs end

    run_worker(redis_url)
    after = _raw(conn, ids)
    for cid in ("late-0", "late-1", "late-2"):
        record = ResultRecord.model_validate_json(after[cid])
        assert record.status == "succeeded", record.error
        assert conn.hget(keys.rq_job_key(ids[cid]), "retries") == b"1"
        assert not conn.hexists(keys.rq_job_key(ids[cid]), "retrying")
    for cid in ("long-0", "long-1", "ok-0", "ok-1"):
        assert after[cid] == before[cid]
        assert conn.hget(keys.rq_job_key(ids[cid]), "retries") is None
    s = batch_status(conn, "retry-cause")
    assert (s.succeeded, s.failed, s.queued, s.finished) == (5, 2, 0, True)
    announced = _announced(conn, "retry-cause")
    assert sorted(announced) == sorted([*ids.values(), ids["late-0"], ids["late-1"], ids["late-2"]])

    # Nothing left of that cause; the other cause's jobs fail the same way when asked for.
    assert client.retry("retry-cause", error_codes=(late_code,)).queued == 0
    report = client.retry("retry-cause", status_codes=("4xx",))
    assert report.queued == 2
    run_worker(redis_url)
    assert _code(conn.get(keys.result_key(ids["long-0"]))) == "context_length_exceeded"
    assert conn.hget(keys.rq_job_key(ids["long-0"]), "retries") == b"1"
    s = batch_status(conn, "retry-cause")
    assert (s.succeeded, s.failed, s.finished) == (5, 2, True)


def test_retry_while_the_batch_runs_runs_each_job_once_more(conn, redis_url, tiny, tmp_path):
    client, ids, later = _mixed_batch(conn, tiny, tmp_path, "retry-running")
    run_worker(redis_url, max_jobs=3)  # the three late jobs failed; four still queued
    s = batch_status(conn, "retry-running")
    assert (s.failed, s.queued) == (3, 4)
    shutil.copytree(tiny.target, later)
    assert client.retry("retry-running").queued == 3
    assert client.retry("retry-running").queued == 0
    run_worker(redis_url)
    s = batch_status(conn, "retry-running")
    assert (s.succeeded, s.failed, s.finished) == (5, 2, True)
    announced = _announced(conn, "retry-running")
    for cid, job_id in ids.items():
        assert announced.count(job_id) == (2 if cid.startswith("late") else 1), cid


def test_a_cancelled_batch_refuses_retry_and_a_pending_retry_stays_failed(
    conn, redis_url, tiny, tmp_path
):
    client, ids, _ = _mixed_batch(conn, tiny, tmp_path, "retry-cancel")
    run_worker(redis_url)
    before = _raw(conn, ids)
    assert client.retry("retry-cancel", status_codes=("400",)).queued == 2
    client.cancel("retry-cancel")
    with pytest.raises(InvalidRequestError, match="cancelled"):
        client.retry("retry-cancel")
    result = invoke("retry", "retry-cancel", "--redis-url", redis_url)
    assert result.exit_code == 1 and "was cancelled" in result.output
    run_worker(redis_url)  # reaches the two queued again: drops them, failed as before
    assert _raw(conn, ids) == before
    s = batch_status(conn, "retry-cancel")
    assert (s.succeeded, s.failed, s.cancelled) == (2, 5, 0)
    for cid in ("long-0", "long-1"):
        assert conn.hget(keys.rq_job_key(ids[cid]), "status") == b"failed"


def test_filters_and_cli_flags_are_checked_by_name(conn, redis_url):
    assert RetryFilter(("5xx", "429")).status_codes == ("5xx", "429")
    for bad in ("6xx", "5x", "abc", "1000"):
        with pytest.raises(InvalidRequestError, match="invalid status code"):
            RetryFilter((bad,))
    with pytest.raises(InvalidRequestError, match="invalid error code"):
        RetryFilter((), ("Bad Code!",))
    result = invoke("retry", "any", "--status-code", "7xx", "--redis-url", redis_url)
    assert result.exit_code == 2 and "invalid status code '7xx'" in result.output
    result = invoke("retry", "no-such-batch", "--redis-url", redis_url)
    assert result.exit_code == 1 and "no batch 'no-such-batch'" in result.output


def test_the_cli_reports_what_it_queued_by_cause(conn, redis_url, tiny, tmp_path):
    _mixed_batch(conn, tiny, tmp_path, "retry-cli")
    run_worker(redis_url)
    args = ("retry", "retry-cli", "--redis-url", redis_url)
    result = invoke(*args, "--error-code", "context_length_exceeded")
    assert result.exit_code == 0, result.output
    assert "2 failed job(s) queued again (2 context_length_exceeded)" in result.output
    assert "3 job(s) failed with another cause" in result.output
    result = invoke(*args, "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert (report["queued"], report["pending"], report["unmatched"]) == (3, 2, 0)


def test_a_retried_job_whose_holder_died_is_recovered_run_and_its_end_counted_once(conn):
    from tests.test_lifecycle import expire, lifecycle, submit

    (job_id,) = submit(conn, batch_id="retry-dead")
    a = lifecycle(conn, "a")
    job = a.take()
    failed = ResultRecord.failed(job.id, "retry-dead", "req-1", GenerationError("disk full"))
    assert a.end(job, failed) is True
    assert Client(connection=conn).retry("retry-dead").queued == 1
    assert a.take().id == job_id  # runs although it has a record: it was queued again
    expire(conn, a)  # ... and its holder died
    b = lifecycle(conn, "b")  # recovers it: back on the queue, not taken as done
    assert conn.lrange(keys.rq_queue_key("mlxq"), 0, -1) == [job_id.encode()]
    job = b.take()
    assert job.id == job_id
    ok = ResultRecord(
        job_id=job_id,
        batch_id="retry-dead",
        custom_id="req-1",
        status="succeeded",
        finished_at=time.time(),
    )
    assert b.end(job, ok) is True
    assert b.end(job, ok) is True  # a retry after a lost reply counts nothing again
    assert ResultRecord.model_validate_json(conn.get(keys.result_key(job_id))).status == (
        "succeeded"
    )
    s = batch_status(conn, "retry-dead")
    assert (s.succeeded, s.failed, s.finished) == (1, 0, True)
    assert conn.llen(keys.batch_done_key("retry-dead")) == 2
