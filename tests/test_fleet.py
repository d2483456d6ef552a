"""Fleet features: model-affine routing, the worker registry, streaming, cancel."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
from click.testing import CliRunner

from producer import Client
from producer.cli import main as producer_main
from producer.streams import iter_chunks
from schemas import keys
from schemas.store import read_result
from tests.conftest import chat, run_worker
from tests.test_faults import one_result, running_execution, slow_job
from tests.waiting import seconds, wait_for


def test_two_workers_serve_their_own_models_and_show_in_the_registry(conn, tiny, workers):
    client = Client(connection=conn)
    exact = {"max_tokens": 4, "temperature": 0, "logit_bias": {"3": -100}}  # no early EOS
    reqs = {f"t{i}": chat(tiny.target, content=f"t{i}", **exact) for i in range(3)}
    reqs |= {f"w{i}": chat(tiny.twin, content=f"w{i}", **exact) for i in range(3)}
    s = client.submit(reqs, route="model")
    assert conn.llen(keys.rq_queue_key(keys.queue_for_model(tiny.target))) == 3
    assert conn.llen(keys.rq_queue_key(keys.queue_for_model(tiny.twin))) == 3
    a = workers("--model", tiny.target, "--no-shared", "--lease-seconds", "2", name="serves-t")
    b = workers("--model", tiny.twin, "--no-shared", "--lease-seconds", "2", name="serves-w")
    records = [one_result(conn, j) for j in s.job_ids]
    by_worker = {r.custom_id: r.metrics.worker_id for r in records}
    assert {by_worker[f"t{i}"] for i in range(3)} == {"serves-t"}
    assert {by_worker[f"w{i}"] for i in range(3)} == {"serves-w"}
    fleet = {w.name: w for w in wait_for(lambda: len(client.fleet()) == 2 and client.fleet())}
    assert [m.name for m in fleet["serves-t"].models] == [tiny.target]  # never the other model
    assert [m.name for m in fleet["serves-w"].models] == [tiny.twin]
    wait_for(
        lambda: {w.name: w.jobs_done for w in client.fleet()} == {"serves-t": 3, "serves-w": 3}
    )
    pair = client.fleet()[0].pairs[0]
    assert pair.jobs == 3 and pair.tokens == 12 and pair.tokens_per_s > 0
    table = CliRunner().invoke(producer_main, ["fleet", "--redis-url", _url(conn)]).output
    assert "serves-t" in table and "serves-w" in table and "tok/s" in table
    # Each worker's model rules: its model directory, its own --model, any hub id.
    real = str(Path(tiny.target).resolve())
    assert f"--model {real}" in fleet["serves-t"].serves
    assert f"--model {real}" not in fleet["serves-w"].serves
    assert "hub: any repository" in fleet["serves-t"].serves
    assert f"serves: dir {Path(tiny.root).resolve().parent}" in table
    b.signal(signal.SIGKILL)
    b.wait()
    wait_for(lambda: [w.name for w in client.fleet()] == ["serves-t"], timeout=20)
    a.signal(signal.SIGTERM)
    assert a.wait() == 0
    wait_for(lambda: client.fleet() == [], timeout=seconds(5))  # a clean exit unpublishes at once


def _url(conn) -> str:
    kw = conn.connection_pool.connection_kwargs
    return f"redis://{kw['host']}:{kw['port']}/0"


def test_job_for_a_model_nobody_serves_waits_visibly(conn, tiny, workers):
    client = Client(connection=conn)
    s = client.submit({"orphan": chat(tiny.draft, max_tokens=2)}, route="model")
    w = workers("--model", tiny.target, "--no-shared", "--lease-seconds", "2", name="other")
    wait_for(lambda: client.fleet())
    out = CliRunner().invoke(
        producer_main, ["status", s.batch_id, "--redis-url", _url(conn), "--json"]
    )
    status = json.loads(out.stdout)
    assert status["queued"] == 1
    assert status["queues_without_workers"] == [keys.queue_for_model(tiny.draft)]
    assert read_result(conn, s.job_ids[0]) is None
    w.signal(signal.SIGTERM)
    w.wait()


def _stream_and_record(conn, redis_url, body):
    client = Client(connection=conn)
    s = client.submit([body | {"stream": True}])
    run_worker(redis_url)
    pieces = list(client.stream(s.job_ids[0], timeout=seconds(10)))
    record = read_result(conn, s.job_ids[0])
    raw = [json.loads(f[b"chunk"]) for _, f in conn.xrange(keys.stream_key(s.job_ids[0]))]
    return pieces, record, raw


def test_stream_chunks_concatenate_to_the_final_message(conn, redis_url, tiny):
    for extra in ({}, {"draft_model": tiny.twin}, {"draft_model": tiny.draft}):
        pieces, record, raw = _stream_and_record(
            conn, redis_url, chat(tiny.target, max_tokens=30, temperature=0, **extra)
        )
        content = record.response.choices[0].message.content
        assert len(pieces) > 3 and "".join(pieces) == content
        assert raw[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        assert {c["id"] for c in raw} == {record.response.id}
        assert all(c["object"] == "chat.completion.chunk" for c in raw)
        assert raw[-1]["choices"][0]["finish_reason"] == "length"
        assert raw[-1]["usage"] == record.response.usage.model_dump()


def test_stream_with_stop_string_never_shows_text_past_the_stop(conn, redis_url, tiny):
    plain = Client(connection=conn).submit([chat(tiny.target, max_tokens=40, temperature=0)])
    run_worker(redis_url)
    full = read_result(conn, plain.job_ids[0]).response.choices[0].message.content
    stop = full[20:24]
    pieces, record, raw = _stream_and_record(
        conn, redis_url, chat(tiny.target, max_tokens=40, temperature=0, stop=[stop])
    )
    assert "".join(pieces) == record.response.choices[0].message.content == full[: full.find(stop)]
    assert raw[-1]["choices"][0]["finish_reason"] == "stop"


def test_stream_is_live_and_tail_prints_it(conn, redis_url, tiny, workers):
    client = Client(connection=conn)
    s = client.submit([slow_job(tiny, stream=True)])
    job_id = s.job_ids[0]
    w = workers(name="streamer")
    wait_for(lambda: conn.xlen(keys.stream_key(job_id)) > 5)
    assert read_result(conn, job_id) is None  # chunks arrive while the job still runs
    out = CliRunner().invoke(producer_main, ["tail", job_id, "--redis-url", redis_url])
    record = one_result(conn, job_id)
    assert out.exit_code == 0
    assert out.stdout.rstrip("\n") == record.response.choices[0].message.content
    w.signal(signal.SIGTERM)
    w.wait()


def test_failed_streaming_job_ends_its_stream_with_an_error(conn, redis_url, tiny):
    client = Client(connection=conn)
    s = client.submit([chat(tiny.small_ctx, content="queue " * 100, stream=True)])
    run_worker(redis_url)
    assert read_result(conn, s.job_ids[0]).error.code == "context_length_exceeded"
    chunks = list(iter_chunks(conn, s.job_ids[0], timeout=seconds(5)))
    assert chunks[-1]["error"]["code"] == "context_length_exceeded"
    with pytest.raises(RuntimeError, match="maximum context length is 64"):
        list(client.stream(s.job_ids[0], timeout=seconds(5)))
    unknown = client.submit([chat(str(tiny.root / "nope"), stream=True)])
    run_worker(redis_url)  # fails before generation starts: still one final error chunk
    chunks = list(iter_chunks(conn, unknown.job_ids[0], timeout=seconds(5)))
    assert [c["error"]["code"] for c in chunks] == ["model_not_found"]


def test_cancel_removes_only_the_batch_queued_jobs(conn, redis_url, tiny):
    client = Client(connection=conn)
    a = client.submit(
        {f"a{i}": chat(tiny.target, max_tokens=2) for i in range(3)}, batch_id="keep-a"
    )
    b = client.submit({f"b{i}": chat(tiny.target, max_tokens=2) for i in range(2)}, batch_id="keep")
    out = CliRunner().invoke(producer_main, ["cancel", "keep", "--redis-url", redis_url])
    assert out.exit_code == 0 and "2 queued job(s) cancelled" in out.stdout
    for job_id in b.job_ids:
        record = client.result(job_id)
        assert record.status == "cancelled" and record.error.code == "cancelled"
    assert client.status("keep").cancelled == 2 and client.status("keep").finished
    # keep's jobs sit behind keep-a's: the worker that reaches them drops them.
    run_worker(redis_url)
    assert conn.llen(keys.rq_queue_key("mlxq")) == 0
    assert all(read_result(conn, j).status == "succeeded" for j in a.job_ids)
    assert all(read_result(conn, j) is None for j in b.job_ids)  # dropped, never run
    assert all(client.result(j).status == "cancelled" for j in b.job_ids)
    assert client.status("keep-a").succeeded == 3 and client.status("keep").cancelled == 2


def test_cancel_stops_running_jobs(conn, redis_url, tiny, workers):
    client = Client(connection=conn)
    running_job = slow_job(tiny, max_tokens=8000)
    s = client.submit({"running": running_job, "queued": chat(tiny.target, max_tokens=2)})
    w = workers(name="busy")
    wait_for(lambda: running_execution(conn, s.job_ids[0]))
    cancelled, running = client.cancel(s.batch_id)
    assert (cancelled, running) == (1, 1)
    record = one_result(conn, s.job_ids[0])
    assert record.status == "cancelled" and record.status_code == 499
    assert record.partial.cut and record.partial.usage.completion_tokens < 8000  # (0: stopped
    # while its prompt filled)
    assert client.result(s.job_ids[1]).status == "cancelled"
    w.signal(signal.SIGTERM)
    w.wait()


def test_a_pairs_throughput_is_tokens_over_wall_time_not_summed_job_time():
    """Twenty jobs of 20 s run together in one batch: the pair was busy 20 s (plus a
    later job's own 5 s), not 405 s."""
    from worker.engine.output import GenerationOutput
    from worker.runner.stats import WorkerStats

    def out(seconds: float, tokens: int) -> GenerationOutput:
        return GenerationOutput("x", "stop", 5, tokens, 0.1, 50.0, 1.0, seconds, 0, 0, 0.0, ())

    stats = WorkerStats()
    for i in range(20):  # they end together (a batch), each after 20 s
        stats.add("m", None, out(20.0, 23), now=100.0 + i * 0.001)
    stats.add("m", None, out(5.0, 5), now=130.0)  # alone, later
    pair = stats.pairs[("m", None)]
    assert pair.seconds == pytest.approx(25.019, abs=0.01)
    assert pair.tokens_per_s == pytest.approx(465 / 25.019, rel=0.01)
