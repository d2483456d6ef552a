"""Stopping a running job (``worker.runner.stops``): one mechanism on every path.

Engines on every architecture: a job stopped mid-way (plain, speculative with a draft or
by prompt lookup, its n choices) keeps exactly the tokens it made (a prefix of its own
greedy run, cut), and rows left in a batch (plain or speculative) decode on unchanged.
The rule: the least time limit wins and is named; cancel flags are read from Redis.
End to end with real worker processes: a batch cancel, a gateway client gone (streamed
or not) and a time limit each stop a running job with one record holding what it made,
in plain, draft and lookup batches and alone; the other jobs are untouched.
"""

from __future__ import annotations

import time

import pytest

from producer.streams import iter_chunks
from schemas import CancelledError, ChatRequest, keys
from schemas.cancel import CANCELLED_AT
from tests.conftest import chat
from tests.test_archs import LONG, _same_greedy, arch  # noqa: F401 (a fixture)
from tests.test_gateway import gateway  # noqa: F401 (a fixture)
from tests.waiting import seconds, wait_for
from worker.engine.batch import BatchEngine
from worker.engine.generator import ChatGenerator
from worker.engine.models import ModelCache
from worker.engine.protocol import Stopped
from worker.engine.sequence import CUT
from worker.engine.specbatch import SpecBatchEngine


class AfterSteps:
    """A stop that comes at its ``n``-th check (one check per step)."""

    def __init__(self, n: int) -> None:
        self.n, self.checks = n, 0

    def check(self) -> None:
        self.checks += 1
        if self.checks >= self.n:
            raise CancelledError("stopped by the test")


def _cut_is_a_prefix(cut, full) -> None:
    assert cut.finish_reason == CUT
    assert 0 < cut.completion_tokens < full.completion_tokens
    assert cut.token_ids == full.token_ids[: len(cut.token_ids)]
    assert full.text.startswith(cut.text)
    assert cut.prompt_tokens == full.prompt_tokens


def _req(model: str, **fields) -> ChatRequest:
    return ChatRequest.model_validate(
        chat(model, content=LONG, **({"max_tokens": 40, "temperature": 0} | fields))
    )


@pytest.mark.parametrize("path", ["plain", "draft", "lookup", "choices"])
def test_a_job_stopped_mid_way_keeps_what_it_made(arch, path):  # noqa: F811
    draft = arch.twin if path == "draft" else None
    gen = ChatGenerator.get_or_create(arch.target, draft, cache=ModelCache(prefix_bytes=0))
    fields = {"n": 2} if path == "choices" else {}
    if path == "lookup":
        fields = {"speculation": {"method": "prompt_lookup", "ngram_min": 1}}
    job = gen.prepare(_req(arch.target, **fields))
    if path == "choices":
        full = gen.generate_choices(job)
        with pytest.raises(Stopped) as got:
            gen.generate_choices(job, stop=AfterSteps(4))
        assert sorted(got.value.outputs) == [0, 1]  # every choice's part
        for tag, whole in ((0, full), (1, full.others[0])):
            _cut_is_a_prefix(got.value.outputs[tag], whole)
        return
    lookup = job.params.lookup if path == "lookup" else None
    if lookup is not None:
        job = job.with_params(num_draft_tokens=4)
    try:
        full = gen.generate(job, use_draft=draft is not None, lookup=lookup)
    except Exception as e:  # (an engine that cannot hold this architecture says so)
        pytest.skip(f"{path} on {arch.name}: {e}")
    with pytest.raises(Stopped) as got:
        gen.generate(job, use_draft=draft is not None, lookup=lookup, stop=AfterSteps(3))
    assert isinstance(got.value.error, CancelledError)
    _cut_is_a_prefix(got.value.outputs[0], full)


@pytest.mark.parametrize("speculative", [False, True])
def test_rows_left_in_a_batch_decode_on_unchanged(arch, speculative):  # noqa: F811
    if speculative and arch.name == "nemotron_h":
        pytest.skip("nemotron_h: no speculative batch (refused by name in test_archs)")
    gen = ChatGenerator.get_or_create(
        arch.target, arch.noisy if speculative else None, cache=ModelCache(prefix_bytes=0)
    )
    reqs = [
        ChatRequest.model_validate(
            chat(arch.target, f"{LONG} {i} " + "job " * i, max_tokens=24, temperature=0)
        )
        for i in range(3)
    ]
    engine = (
        SpecBatchEngine(gen.target, gen.draft, 3) if speculative else BatchEngine(gen.target, 8)
    )
    for i, r in enumerate(reqs):
        engine.add(i, gen.prepare(r))
    outs, cut, steps = {}, None, 0
    while len(engine):
        for tag, out in engine.step().done:
            outs[tag] = out
        steps += engine.first_token_at(1) is not None  # steps since row 1 began to decode
        if steps == 3 and cut is None:
            cut = engine.remove(1)
            assert engine.remove(1) is None  # once
    engine.close()
    assert cut is not None and cut.finish_reason == CUT and 1 not in outs
    whole = gen.generate(gen.prepare(reqs[1]), use_draft=False)
    assert cut.token_ids == whole.token_ids[: len(cut.token_ids)] and cut.completion_tokens > 0
    for i in (0, 2):
        _same_greedy(
            gen, reqs[i], outs[i].token_ids, gen.generate(reqs[i], use_draft=False).token_ids
        )


# -- the rule -------------------------------------------------------------------------
def _job(conn, batch: str, timeout_s=None, begun_s_ago: float = 0.0, **fields):
    from schemas import JobEnvelope
    from worker.lifecycle.held import Job, Start

    job_id = keys.job_id_for(batch, "c")
    env = JobEnvelope(
        job_id=job_id,
        batch_id=batch,
        custom_id="c",
        submitted_at=time.time(),
        request=chat("m", **fields),
    )
    started = Start(perf=time.perf_counter() - begun_s_ago)
    return Job(id=job_id, queue="mlxq", envelope=env, timeout_s=timeout_s, started=started)


def test_the_least_time_limit_wins_and_is_named(conn):
    from worker.runner.stops import deadline_of

    assert deadline_of(_job(conn, "b")) is None
    assert deadline_of(_job(conn, "b", timeout_s=3600), 30).why == "the worker's --time-limit"
    d = deadline_of(_job(conn, "b", timeout_s=3600, time_limit_s=5), 30)
    assert (d.timeout_s, d.why) == (5, "time_limit_s")
    d = deadline_of(_job(conn, "b", timeout_s=2, time_limit_s=5), None)
    assert (d.timeout_s, d.why) == (2, "the batch's job timeout")
    assert "time_limit_s" in str(deadline_of(_job(conn, "b", time_limit_s=5)).error())


def test_cancel_flags_are_read_from_redis_and_a_passed_limit_stops(conn):
    from worker.runner.stops import Stops

    a, b = _job(conn, "keep"), _job(conn, "gone")
    stops = Stops(conn, every=0)
    assert stops.due([a, b]) == []
    conn.hset(keys.batch_key("gone"), CANCELLED_AT, "1")
    assert [(j.id, e.code) for j, e in stops.due([a, b])] == [(b.id, "cancelled")]
    late = _job(conn, "late", begun_s_ago=1.0, time_limit_s=0.5)
    assert [(j.id, e.code) for j, e in stops.due([a, late])] == [(late.id, "timeout")]
    with pytest.raises(CancelledError):
        stops.of(b).check()


# -- end to end: real workers -------------------------------------------------------
LONG_RUN = 8000  # tokens: far past any stop in these tests, on any machine
LIMIT_S = seconds(2)  # a time limit that leaves a first token made, at this machine's pace


def _extra(tiny, how: str) -> dict:
    return {
        "plain": {},
        "draft": {"draft_model": tiny.draft},
        "lookup": {"speculation": {"method": "prompt_lookup"}},
    }[how]


def _stopped(record, code: str, status: str, least: int = 1) -> None:
    """``least``: tokens it must have made (0: it may be stopped while its prompt fills)."""
    assert record.status == status and record.error.code == code, record
    assert record.partial is not None and record.partial.cut
    assert least <= record.partial.usage.completion_tokens < LONG_RUN
    assert record.partial.usage.prompt_tokens > 0


@pytest.mark.parametrize("how", ["plain", "draft", "lookup"])
def test_a_batch_cancel_stops_its_running_jobs_and_spares_the_rest(conn, tiny, workers, how):
    from producer import Client
    from tests.test_faults import one_result, slow_job

    client = Client(connection=conn)
    extra = _extra(tiny, how)
    x = client.submit(
        {f"x{i}": slow_job(tiny, max_tokens=LONG_RUN, **extra) for i in range(2)}, batch_id="x"
    )
    y = client.submit({"y": slow_job(tiny, max_tokens=LONG_RUN, **extra)}, batch_id="y")
    w = workers("--max-batch", "4", "--speculative", "always", "--burst")
    for job_id in [*x.job_ids, *y.job_ids]:
        w.begun(job_id)
    client.cancel("x")
    stopped = [one_result(conn, j) for j in x.job_ids]
    for record in stopped:
        _stopped(record, "cancelled", "cancelled", least=0)  # (maybe before a first token)
        assert record.status_code == 499 and record.metrics.batch_size == 3  # in one batch
    assert conn.hexists(keys.RUNNING, y.job_ids[0])  # the other batch's job runs on
    assert client.result(y.job_ids[0]) is None
    client.cancel("y")
    last = one_result(conn, y.job_ids[0])
    _stopped(last, "cancelled", "cancelled")
    assert last.partial.usage.completion_tokens > max(
        r.partial.usage.completion_tokens for r in stopped
    )  # it ran on after them
    assert w.wait() == 0  # nothing left: the worker's burst ends
    assert conn.hlen(keys.RUNNING) == 0


def test_a_time_limit_stops_a_job_batched_alone_with_n_and_streamed(conn, tiny, workers):
    from producer import Client
    from tests.test_faults import one_result, slow_job

    client = Client(connection=conn)
    limited = {
        "batched": slow_job(tiny, max_tokens=LONG_RUN, time_limit_s=LIMIT_S),
        "free": slow_job(tiny, max_tokens=64),
        "choices": slow_job(tiny, max_tokens=LONG_RUN, time_limit_s=LIMIT_S, n=2),
        "streamed": slow_job(tiny, max_tokens=LONG_RUN, time_limit_s=LIMIT_S, stream=True),
    }
    s = client.submit(limited, batch_id="limits")
    workers("--max-batch", "4", "--burst")
    got = dict(zip(limited, (one_result(conn, j) for j in s.job_ids), strict=True))
    for name in ("batched", "choices", "streamed"):
        _stopped(got[name], "timeout", "failed")
        assert got[name].status_code == 504 and "time_limit_s" in got[name].error.message
    assert len(got["choices"].partial.texts) == 2
    assert got["free"].status == "succeeded"
    assert got["free"].response.usage.completion_tokens == 64
    chunks = list(iter_chunks(conn, s.job_ids[3], timeout=seconds(30)))
    assert chunks[-1]["error"]["code"] == "timeout"  # the stream's readers see why it ended
    assert len(chunks) > 2  # text came before it


def test_the_workers_time_limit_stops_a_job_that_sets_none(conn, tiny, workers):
    from producer import Client
    from tests.test_faults import one_result, slow_job

    s = Client(connection=conn).submit([slow_job(tiny, max_tokens=LONG_RUN)])
    workers("--time-limit", str(LIMIT_S), "--burst")
    record = one_result(conn, s.job_ids[0])
    _stopped(record, "timeout", "failed")
    assert "--time-limit" in record.error.message


@pytest.mark.parametrize("stream", [True, False])
def test_a_gateway_client_gone_stops_its_running_job(conn, tiny, workers, gateway, stream):  # noqa: F811
    import socket

    from tests.test_faults import one_result, slow_job
    from tests.test_gateway import raw_chat

    gw = gateway()
    w = workers()
    with socket.create_connection(("127.0.0.1", gw.port)) as sock:
        sock.sendall(raw_chat(slow_job(tiny, max_tokens=LONG_RUN, stream=stream)))
        job_id = wait_for(lambda: [j.decode() for j in conn.hkeys(keys.RUNNING)], every=0.05)[0]
        w.begun(job_id)
        if stream:  # a few chunks read, then the client goes away
            sock.settimeout(seconds(30))
            got = b""
            while got.count(b"data: ") < 3:
                got += sock.recv(4096)
    record = one_result(conn, job_id)
    _stopped(record, "cancelled", "cancelled", least=1 if stream else 0)
    assert conn.hlen(keys.RUNNING) == 0


def test_sigkill_while_stopping_loses_nothing(conn, tiny, workers):
    """A worker killed as it stops a cancelled job (before or after its record): the job's
    lease runs out, and it ends cancelled once (its record, or dropped by the next take
    as its batch is cancelled); the batch's other job still runs, on another worker."""
    import signal

    from producer import Client
    from tests.test_faults import one_result, slow_job

    client = Client(connection=conn)
    doomed = client.submit({"doomed": slow_job(tiny, max_tokens=LONG_RUN)}, batch_id="doomed")
    kept = client.submit({"kept": slow_job(tiny, max_tokens=16)}, batch_id="kept")
    a = workers("--lease-seconds", "2", "--max-batch", "1", name="a")
    a.begun(doomed.job_ids[0])
    client.cancel("doomed")
    a.signal(signal.SIGKILL)
    a.wait()
    b = workers("--lease-seconds", "2", "--max-batch", "1", name="b")
    assert one_result(conn, kept.job_ids[0]).status == "succeeded"
    wait_for(lambda: conn.hlen(keys.RUNNING) == 0)  # a's lease ran out: recovered
    b.signal(signal.SIGTERM)
    assert b.wait() == 0
    result = client.result(doomed.job_ids[0])  # its record, or cancelled from the flag
    assert result is not None and result.status == "cancelled"
    status = client.status("doomed")
    assert (status.cancelled, status.succeeded, status.failed) == (1, 0, 0)


@pytest.mark.parametrize("bad", [0, -1, "soon", 1e9])
def test_a_bad_time_limit_is_refused_by_name(bad):
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="time_limit_s"):
        ChatRequest.model_validate(chat("m", time_limit_s=bad))


def test_responses_and_completions_carry_the_time_limit():
    from schemas.completions import CompletionRequest
    from schemas.responses import ResponsesRequest, to_chat

    asked = to_chat(ResponsesRequest(model="m", input="hi", time_limit_s=3), [])
    assert ChatRequest.model_validate(asked).time_limit_s == 3
    legacy = CompletionRequest(model="m", prompt="x", time_limit_s=2).to_chat()
    assert ChatRequest.model_validate(legacy).time_limit_s == 2
