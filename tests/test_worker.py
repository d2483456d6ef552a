import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from rq import Queue
from rq.job import Job
from rq.serializers import JSONSerializer

from producer import Client
from producer.cli import main as producer_main
from schemas import keys
from schemas.result import BatchOutputLine, ChatCompletion
from schemas.store import read_result
from tests.conftest import chat, run_worker, write_jsonl
from tests.waiting import seconds
from worker.engine.models import ModelCache
from worker.runner import runtime

ROOT = Path(__file__).resolve().parents[1]


def bin_path(name: str) -> str:
    return str(Path(sys.executable).with_name(name))


def test_end_to_end_through_producer_cli_and_worker_process(tmp_path, conn, redis_url, tiny):
    lines = [
        {
            "custom_id": "plain",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": chat(tiny.target, max_tokens=8, temperature=0),
        },
        {
            "custom_id": "spec",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": chat(tiny.target, max_tokens=8, temperature=0, draft_model=tiny.twin),
        },
        chat(tiny.target, content="seeded", max_tokens=5, seed=1, stop=["zzz"]),
    ]
    path = write_jsonl(tmp_path / "jobs.jsonl", lines)
    submitted = CliRunner().invoke(producer_main, ["submit", str(path), "--redis-url", redis_url])
    assert submitted.exit_code == 0, submitted.output
    batch = submitted.stdout.strip()
    env = os.environ | {"MLXQ_REDIS_URL": redis_url, "MLXQ_MODEL_DIRS": str(tiny.root)}
    proc = subprocess.run(
        [bin_path("worker"), "--burst", "--name", "e2e", "--speculative", "always"],
        env=env,
        capture_output=True,
        text=True,
        timeout=seconds(300),
    )
    assert proc.returncode == 0, proc.stderr
    out = tmp_path / "out.jsonl"
    res = CliRunner().invoke(
        producer_main, ["results", batch, "--redis-url", redis_url, "-o", str(out)]
    )
    assert res.exit_code == 0, res.output
    parsed = [BatchOutputLine.model_validate_json(x) for x in out.read_text().splitlines()]
    assert [p.custom_id for p in parsed] == ["plain", "spec", "line-3"]
    for line in parsed:
        assert line.error is None and line.response.status_code == 200
        completion = ChatCompletion.model_validate(line.response.body)
        assert completion.usage.total_tokens == (
            completion.usage.prompt_tokens + completion.usage.completion_tokens
        )
        assert completion.choices[0].finish_reason == "length"
        metrics = line.response.body["mlxq_metrics"]
        assert metrics["worker_id"] == "e2e" and metrics["total_time_s"] > 0
        assert metrics["mlx_version"] and metrics["mlx_lm_version"]
    plain, spec = (ChatCompletion.model_validate(p.response.body) for p in parsed[:2])
    assert plain.choices[0].message.content == spec.choices[0].message.content
    assert parsed[1].response.body["mlxq_metrics"]["acceptance_rate"] == 1.0
    assert parsed[1].response.body["mlxq_metrics"]["speculative"] is True
    assert parsed[0].response.body["mlxq_metrics"]["speculative"] is False
    assert parsed[1].response.body["mlxq_metrics"]["draft_model"] == tiny.twin


def test_failures_get_error_records_and_the_next_job_runs(conn, redis_url, tiny):
    client = Client(connection=conn)
    long_prompt = "queue worker " * 80
    summary = client.submit(
        {
            "unknown": chat(str(tiny.root / "no-such-model")),
            "alien": chat(tiny.target, draft_model=tiny.alien),
            "too-long": chat(tiny.small_ctx, content=long_prompt),
            "denied": chat(tiny.draft),
            "ok": chat(tiny.target, max_tokens=4),
        }
    )
    allowed = [str(tiny.root / n) for n in ("no-such-model", "alien", "small-ctx")]
    rt = runtime.WorkerRuntime(
        cache=ModelCache(), worker_id="w1", allow_models=("*/target", *allowed)
    )  # not the draft
    run_worker(redis_url, runtime=rt)
    records = dict(
        zip(
            ["unknown", "alien", "too-long", "denied", "ok"],
            client.results(summary.batch_id),
            strict=True,
        )
    )
    codes = {k: (r.status, r.error.code if r.error else None) for k, r in records.items()}
    assert codes == {
        "unknown": ("failed", "model_not_found"),
        "alien": ("failed", "incompatible_draft_model"),
        "too-long": ("failed", "context_length_exceeded"),
        "denied": ("failed", "model_not_allowed"),
        "ok": ("succeeded", None),
    }
    assert "not allowed on this worker" in records["denied"].error.message
    assert records["unknown"].status_code == 404
    status = client.status(summary.batch_id)
    assert (status.succeeded, status.failed, status.queued, status.running) == (1, 4, 0, 0)


def test_warm_model_reports_cache_hit_and_zero_load_time(conn, redis_url, tiny):
    client = Client(connection=conn)
    s = client.submit([chat(tiny.target, max_tokens=3), chat(tiny.target, max_tokens=3)])
    run_worker(redis_url, runtime=runtime.WorkerRuntime(cache=ModelCache()))
    first, second = (r.metrics for r in client.results(s.batch_id))
    assert first.cache_hit is False and first.load_time_s > 0
    assert second.cache_hit is True and second.load_time_s == 0.0
    assert first.queue_wait_s >= 0 and second.queue_wait_s >= first.queue_wait_s


def test_batch_done_list_can_be_blpopped(conn, redis_url, tiny):
    client = Client(connection=conn)
    s = client.submit({"a": chat(tiny.target, max_tokens=2), "b": chat(tiny.target, max_tokens=2)})
    run_worker(redis_url)
    popped = [
        conn.blpop([keys.batch_done_key(s.batch_id)], timeout=1)[1].decode() for _ in range(2)
    ]
    assert sorted(popped) == sorted(s.job_ids)
    assert read_result(conn, popped[0]).status == "succeeded"


def test_hostile_job_hash_runs_nothing_and_worker_goes_on(conn, redis_url, tiny, tmp_path):
    marker = tmp_path / "pwned"
    q = Queue("mlxq", connection=conn, serializer=JSONSerializer)
    q.enqueue("os.system", f"touch {marker}", job_id="evil-1")
    good = Client(connection=conn).submit([chat(tiny.target, max_tokens=2)])
    run_worker(redis_url)
    assert not marker.exists()
    assert read_result(conn, good.job_ids[0]).status == "succeeded"

    job = Job.fetch("evil-1", connection=conn, serializer=JSONSerializer)
    assert job.get_status() == "failed"
    assert "runs only worker.jobs.run_chat_job" in (job.latest_result().exc_string or "")


@pytest.mark.parametrize("max_batch", [1, 4])
def test_duplicate_enqueue_runs_once_and_writes_one_result(conn, redis_url, tiny, max_batch):
    client = Client(connection=conn)
    s = client.submit({"x": chat(tiny.target, max_tokens=3)})
    job_id = s.job_ids[0]
    conn.rpush(keys.rq_queue_key("mlxq"), job_id)  # the same job queued twice
    rt = run_worker(redis_url, max_batch=max_batch)
    assert conn.hget(keys.batch_key(s.batch_id), "succeeded") == b"1"
    assert conn.llen(keys.batch_done_key(s.batch_id)) == 1
    assert json.loads(conn.get(keys.result_key(job_id)))["status"] == "succeeded"
    # The copy was taken after the first run ended: it was dropped, not run.
    assert rt.stats.jobs_done == 1
    job = Job.fetch(job_id, connection=conn, serializer=JSONSerializer)
    assert job.get_status() == "finished"
    assert conn.llen(keys.rq_queue_key("mlxq")) == 0 and conn.hlen(keys.RUNNING) == 0


def test_invalid_payload_gets_a_failed_record(conn, redis_url, tiny):
    q = Queue("mlxq", connection=conn, serializer=JSONSerializer)
    payload = {
        "job_id": "b9-x",
        "batch_id": "b9",
        "custom_id": "c",
        "submitted_at": 1.0,
        "request": {"model": tiny.target, "messages": []},
    }
    q.enqueue(keys.JOB_FUNCTION, payload, job_id="b9-x")
    run_worker(redis_url)
    record = read_result(conn, "b9-x")
    assert record.status == "failed" and record.error.code == "invalid_request"
    assert "messages: List should have at least 1 item" in record.error.message
    assert record.custom_id == "c" and record.status_code == 400


def test_pickled_job_is_never_unpickled(conn, redis_url, tiny, tmp_path):
    import pickle
    import zlib

    marker = tmp_path / "unpickled"

    class Boom:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    data = zlib.compress(pickle.dumps((keys.JOB_FUNCTION, None, (Boom(),), {})))
    conn.hset(
        keys.rq_job_key("pickled-1"),
        mapping={
            "data": data,
            "status": "queued",
            "origin": "mlxq",
            "created_at": "2026-01-01T00:00:00Z",
            "description": "x",
        },
    )
    conn.rpush(keys.rq_queue_key("mlxq"), "pickled-1")
    good = Client(connection=conn).submit([chat(tiny.target, max_tokens=2)])
    run_worker(redis_url)
    assert not marker.exists()
    assert conn.hget(keys.rq_job_key("pickled-1"), "status") == b"failed"
    assert read_result(conn, good.job_ids[0]).status == "succeeded"


def test_worker_cli_preloads_and_rejects_bad_flags(redis_url, tiny):
    env = os.environ | {"MLXQ_REDIS_URL": redis_url}
    ok = subprocess.run(
        [bin_path("worker"), "--burst", "--model", tiny.target],
        env=env,
        capture_output=True,
        text=True,
        timeout=seconds(120),
    )
    assert ok.returncode == 0 and f"preloaded {tiny.target}" in ok.stderr
    missing = subprocess.run(
        [bin_path("worker"), "--burst", "--model", "/nope/model"],
        env=env,
        capture_output=True,
        text=True,
        timeout=seconds(120),
    )
    assert missing.returncode == 1
    assert "--model /nope/model: model '/nope/model': no such local directory" in missing.stderr
    assert "Traceback" not in missing.stderr
    denied = subprocess.run(
        [bin_path("worker"), "--burst", "--model", tiny.target, "--allow-model", "mlx-community/*"],
        env=env,
        capture_output=True,
        text=True,
        timeout=seconds(120),
    )
    assert denied.returncode == 1 and "not allowed on this worker" in denied.stderr
    bad = subprocess.run(
        [bin_path("worker"), "--cache-gb", "-1"],
        env=env,
        capture_output=True,
        text=True,
        timeout=seconds(120),
    )
    assert bad.returncode == 2 and "--cache-gb" in bad.stderr


@pytest.mark.parametrize("max_batch", [1, 4])
def test_job_whose_result_exists_is_not_run_again(conn, redis_url, tiny, max_batch):
    # e.g. requeued by recovery after its worker wrote the result and died
    s = Client(connection=conn).submit({"x": chat(tiny.target, max_tokens=3)})
    first = run_worker(redis_url, max_batch=max_batch)
    assert first.stats.jobs_done == 1
    before = conn.get(keys.result_key(s.job_ids[0]))
    conn.rpush(keys.rq_queue_key("mlxq"), s.job_ids[0])
    again = run_worker(redis_url, max_batch=max_batch)
    assert again.stats.jobs_done == 0
    assert conn.get(keys.result_key(s.job_ids[0])) == before
    assert conn.llen(keys.rq_queue_key("mlxq")) == 0


def test_worker_help_lists_its_commands():
    from worker.cli import main as worker_main

    out = CliRunner().invoke(worker_main, ["--help"]).output
    assert "Commands:\n  import-gguf  Import a GGUF FILE" in out
    bad = CliRunner().invoke(worker_main, ["import-gguf", "/nonexistent.gguf", "/tmp/out"])
    assert bad.exit_code == 1 and "/nonexistent.gguf" in bad.output
