import json
import subprocess
import sys

import pytest
from click.testing import CliRunner
from redis import Redis
from rq.job import Job

from producer.cli import main
from schemas import keys
from schemas.result import BatchOutputLine
from tests.conftest import chat, write_jsonl

BAD_LINES = [
    ("{not json", "not valid JSON"),
    ('["a list"]', "expected a JSON object"),
    (chat("m") | {"messages": []}, "messages: List should have at least 1 item"),
    (chat("m") | {"messages": [{"role": "robot", "content": "x"}]}, "messages.0.role"),
    (chat("m", max_tokens=-3), "max_tokens: Input should be greater than or equal to 1"),
    (chat("m", temperature=9), "temperature: Input should be less than or equal to 2"),
    (chat("m", tools=[{"type": "function"}]), "tools.0.function: Field required"),
    ({"custom_id": "x", "method": "POST", "url": "/v1/audio/speech", "body": chat("m")}, "url:"),
    (
        {"custom_id": "x", "method": "POST", "url": "/v1/responses", "body": {"input": "x"}},
        "body.model: Field required",
    ),
    (
        {"custom_id": "x", "method": "POST", "url": "/v1/embeddings", "body": chat("m")},
        "body.input: Field required; unknown field 'messages' in body",
    ),
    (chat("m", colour="blue"), "unknown field 'colour'"),
    (
        {"custom_id": "dup", "method": "POST", "url": "/v1/chat/completions", "body": chat("m")},
        None,
    ),
    (
        {"custom_id": "dup", "method": "POST", "url": "/v1/chat/completions", "body": chat("m")},
        "duplicate custom_id 'dup' (first used on line 12)",
    ),
    (
        {"custom_id": "y", "method": "POST", "url": "/v1/chat/completions", "body": chat("m", n=0)},
        "body.n: Input should be greater than or equal to 1",
    ),
    (chat("m", response_format={"type": "json_object"}), None),
    (
        chat(
            "m",
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "array", "uniqueItems": True}},
            },
        ),
        'json_schema.schema cannot be enforced: Unimplemented keys: ["uniqueItems"]',
    ),
]


def invoke(*args, env=None):
    return CliRunner().invoke(main, [str(a) for a in args], env=env, catch_exceptions=False)


def test_every_bad_line_is_reported_and_nothing_is_enqueued(tmp_path, conn, redis_url):
    path = write_jsonl(tmp_path / "jobs.jsonl", [line for line, _ in BAD_LINES])
    result = invoke("submit", path, "--redis-url", redis_url)
    assert result.exit_code == 2
    errors = result.stderr.splitlines()
    for lineno, (_, expected) in enumerate(BAD_LINES, start=1):
        mine = [e for e in errors if e.startswith(f"{path}:{lineno}: ")]
        if expected is None:
            assert mine == []
        else:
            assert len(mine) == 1 and expected in mine[0], (lineno, mine)
    assert conn.dbsize() == 0


def test_skip_invalid_enqueues_good_lines_and_writes_rejects(tmp_path, conn, redis_url):
    path = write_jsonl(tmp_path / "jobs.jsonl", [chat("m"), "{oops", chat("m", top_k=-1)])
    result = invoke("submit", path, "--redis-url", redis_url, "--skip-invalid", "--json")
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["submitted"] == 1 and summary["invalid"] == 2
    rejected = (tmp_path / "jobs.jsonl.rejected.jsonl").read_text().splitlines()
    assert rejected[0] == "{oops" and json.loads(rejected[1])["top_k"] == -1
    assert conn.llen(keys.rq_queue_key("mlxq")) == 1


def test_batch_file_and_plain_file_enqueue_the_same_jobs(tmp_path, conn, redis_url):
    bodies = [chat("m", content=f"q{i}", max_tokens=5 + i) for i in range(3)]
    plain = write_jsonl(
        tmp_path / "plain.jsonl", [b | {"custom_id": f"r{i}"} for i, b in enumerate(bodies)]
    )
    batch = write_jsonl(
        tmp_path / "batch.jsonl",
        [
            {"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions", "body": b}
            for i, b in enumerate(bodies)
        ],
    )
    payloads = {}
    for name, path in [("plain", plain), ("batch", batch)]:
        r = invoke("submit", path, "--redis-url", redis_url, "--batch-id", f"b-{name}")
        assert r.exit_code == 0 and r.stdout.strip() == f"b-{name}"
        ids = [j.decode() for j in conn.lrange(keys.batch_jobs_key(f"b-{name}"), 0, -1)]
        assert len(ids) == 3
        for job_id in ids:
            raw = conn.hget(keys.rq_job_key(job_id), "data")
            import zlib

            data = json.loads(zlib.decompress(raw))  # JSON, never pickle
            func, instance, args, kwargs = data
            assert func == keys.JOB_FUNCTION and instance is None and kwargs == {}
            env = args[0]
            payloads.setdefault(name, []).append(
                (env["custom_id"], env["request"], job_id.split("-", 2)[-1])
            )
    assert payloads["plain"] == payloads["batch"]


def test_resubmission_with_same_batch_id_adds_nothing(tmp_path, conn, redis_url):
    path = write_jsonl(tmp_path / "jobs.jsonl", [chat("m", content=str(i)) for i in range(5)])
    first = invoke("submit", path, "--redis-url", redis_url, "--batch-id", "again", "--json")
    again = invoke("submit", path, "--redis-url", redis_url, "--batch-id", "again", "--json")
    assert json.loads(first.stdout)["submitted"] == 5
    assert json.loads(again.stdout)["submitted"] == 0
    assert json.loads(again.stdout)["already_present"] == 5
    assert conn.llen(keys.rq_queue_key("mlxq")) == 5
    assert conn.llen(keys.batch_jobs_key("again")) == 5
    assert conn.hget(keys.batch_key("again"), "total") == b"5"


def test_large_submits_start_with_a_small_chunk_and_keep_order(conn):
    from producer.submit import SubmitItem, submit_items
    from schemas import ChatRequest

    items = [
        SubmitItem(str(i), ChatRequest.model_validate(chat("m", content=str(i))))
        for i in range(200)
    ]
    chunks: list[int] = []
    s = submit_items(conn, items, batch_id="ramp", chunk_size=64, progress=chunks.append)
    # Workers can start after the first 32 jobs; chunks double up to the size.
    assert chunks == [32, 64, 64, 40]
    assert s.submitted == 200
    queued = [j.decode() for j in conn.lrange(keys.rq_queue_key("mlxq"), 0, -1)]
    assert queued == s.job_ids == [keys.job_id_for("ramp", str(i)) for i in range(200)]
    assert conn.hget(keys.batch_key("ramp"), "total") == b"200"


def test_defaults_fill_missing_model_and_draft(tmp_path, conn, redis_url):
    lines = [
        {"messages": [{"role": "user", "content": "x"}]},
        {"messages": [{"role": "user", "content": "y"}], "draft_model": None},
        {
            "messages": [{"role": "user", "content": "z"}],
            "speculation": {"method": "prompt_lookup"},
        },
    ]
    path = write_jsonl(tmp_path / "jobs.jsonl", lines)
    r = invoke(
        "submit",
        path,
        "--redis-url",
        redis_url,
        "--model",
        "tgt",
        "--draft-model",
        "dft",
        "--num-draft-tokens",
        "5",
        "--batch-id",
        "d",
    )
    assert r.exit_code == 0, r.output
    ids = [j.decode() for j in conn.lrange(keys.batch_jobs_key("d"), 0, -1)]
    from rq.serializers import JSONSerializer

    reqs = [
        Job.fetch(i, connection=conn, serializer=JSONSerializer).args[0]["request"] for i in ids
    ]
    assert reqs[0]["model"] == "tgt" and reqs[0]["draft_model"] == "dft"
    assert reqs[0]["num_draft_tokens"] == 5
    assert reqs[1]["model"] == "tgt" and reqs[1].get("draft_model") is None
    # a line that says how it speculates keeps it: no default draft, no draft count
    assert reqs[2].get("draft_model") is None and reqs[2].get("num_draft_tokens") is None
    assert reqs[2]["speculation"]["method"] == "prompt_lookup"


def test_missing_model_without_default_is_a_line_error(tmp_path, redis_url):
    path = write_jsonl(tmp_path / "jobs.jsonl", [{"messages": [{"role": "user", "content": "x"}]}])
    r = invoke("submit", path, "--redis-url", redis_url)
    assert r.exit_code == 2 and f"{path}:1: model: Field required" in r.stderr


def test_bad_flags_and_unreachable_redis_are_clean_errors(tmp_path):
    path = write_jsonl(tmp_path / "jobs.jsonl", [chat("m")])
    r = invoke("submit", path, "--batch-id", "no spaces please")
    assert r.exit_code == 2 and "invalid batch id" in r.output
    r = invoke("submit", path, "--num-draft-tokens", "0")
    assert r.exit_code == 2 and "--num-draft-tokens" in r.output
    r = invoke("submit", path, "--redis-url", "redis://:hunter2@127.0.0.1:1/0")
    assert r.exit_code == 1 and "cannot reach Redis" in r.output
    assert "hunter2" not in r.output and "***" in r.output


def test_results_writes_openai_batch_lines(tmp_path, conn, redis_url):
    from schemas import ErrorInfo, ResultRecord
    from schemas.store import write_result
    from tests.test_store import succeeded_record

    path = write_jsonl(
        tmp_path / "jobs.jsonl", [chat("m") | {"custom_id": c} for c in ("ok", "bad", "open")]
    )
    invoke("submit", path, "--redis-url", redis_url, "--batch-id", "res")
    ids = [j.decode() for j in conn.lrange(keys.batch_jobs_key("res"), 0, -1)]
    write_result(conn, succeeded_record(ids[0], "res", "ok", "hello"), 60)
    write_result(
        conn,
        ResultRecord(
            job_id=ids[1],
            batch_id="res",
            custom_id="bad",
            status="failed",
            status_code=404,
            error=ErrorInfo(message="nope", code="model_not_found"),
            finished_at=1.0,
        ),
        60,
    )
    status = invoke("status", "res", "--redis-url", redis_url, "--json")
    counts = json.loads(status.stdout)
    assert (counts["succeeded"], counts["failed"], counts["queued"]) == (1, 1, 1)
    out = tmp_path / "out.jsonl"
    r = invoke("results", "res", "--redis-url", redis_url, "-o", out)
    assert r.exit_code == 0 and "1 job(s) not finished" in r.stderr
    lines = [BatchOutputLine.model_validate_json(x) for x in out.read_text().splitlines()]
    assert [ln.custom_id for ln in lines] == ["ok", "bad"]
    assert lines[0].response.status_code == 200 and lines[0].error is None
    body = lines[0].response.body
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"]["content"] == "hello"
    assert lines[1].error.code == "model_not_found" and lines[1].response.status_code == 404


def test_unknown_batch_is_a_clean_error(redis_url):
    r = invoke("status", "nope", "--redis-url", redis_url)
    assert r.exit_code == 1 and "no batch 'nope'" in r.output


def test_import_producer_does_not_import_mlx():
    code = (
        "import sys, producer, producer.cli; print(any(m.startswith('mlx') for m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("module", ["schemas", "producer"])
def test_contract_modules_never_import_worker(module):
    code = f"import sys, {module}; print(any(m.startswith('worker') for m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_redis_reachable_via_env_var(tmp_path, conn, redis_url):
    path = write_jsonl(tmp_path / "jobs.jsonl", [chat("m")])
    r = invoke("submit", path, env={"MLXQ_REDIS_URL": redis_url})
    assert r.exit_code == 0
    assert Redis.from_url(redis_url).llen(keys.rq_queue_key("mlxq")) == 1


def test_status_rate_is_jobs_over_wall_time_when_a_batch_ends_at_once(conn, redis_url, tiny):
    """Eight jobs decoded together end within milliseconds of each other: the rate is
    eight jobs over the batch's wall time, not seven over those milliseconds."""
    import time

    from producer.batches import batch_status
    from tests.conftest import run_jobs

    jobs = {f"c{i}": chat(tiny.target, max_tokens=24, temperature=0) for i in range(8)}
    began = time.time()
    run_jobs(conn, redis_url, jobs, "burst", max_batch=8)
    wall = time.time() - began
    s = batch_status(conn, "burst")
    assert s.finished and s.eta_s == 0
    assert 8 / wall <= s.rate_per_s <= 8 / (wall * 0.2), (s.rate_per_s, wall)
    line = invoke("status", "burst", "--redis-url", redis_url).stdout
    assert f"{s.rate_per_s:.2f} jobs/s" in line


def test_watch_rate_is_the_last_minutes():
    from producer.batches import RateWindow

    w = RateWindow(span=60, least=10)
    assert w.add(0.0, 0) is None and w.add(5.0, 100) is None  # too soon to say
    assert w.add(10.0, 200) == 20.0
    for t in range(15, 125, 5):  # then 1 job a second for a while
        rate = w.add(float(t), 200 + (t - 10) // 5 * 5)
    assert rate == pytest.approx(1.0, rel=0.1)  # the early burst has left the window
