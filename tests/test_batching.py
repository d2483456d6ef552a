"""Continuous batching: jobs on one model decode together, each with its own result."""

from __future__ import annotations

from producer import Client
from schemas import keys
from schemas.store import read_result
from tests.conftest import chat, run_worker
from tests.test_choices import NO_EOS
from worker.engine.models import ModelCache
from worker.runner import runtime
from worker.schedule.batchsize import ADAPTIVE, PLAIN
from worker.schedule.policy import Decision, SpeculationPolicy


def _jobs(tiny):
    return {
        "a": chat(tiny.target, content="first", max_tokens=12, temperature=0),
        "b": chat(tiny.target, content="a longer second prompt here", max_tokens=30, temperature=0),
        "c": chat(tiny.target, content="third", max_tokens=5, temperature=0),
        "d": chat(tiny.target, content="fourth one", max_tokens=25, temperature=0, stop=["e"]),
        "e": chat(
            tiny.target, content="fifth", max_tokens=20, temperature=0, logit_bias={"42": 100}
        ),
        "f": chat(tiny.target, content="sixth", max_tokens=18, temperature=0),
    }


def _run(conn, redis_url, tiny, max_batch, batch_id):
    s = Client(connection=conn).submit(_jobs(tiny), batch_id=batch_id)
    rt = runtime.WorkerRuntime(cache=ModelCache(), worker_id=f"b{max_batch}")
    run_worker(redis_url, runtime=rt, max_batch=max_batch)
    return {r.custom_id: r for r in (read_result(conn, j) for j in s.job_ids)}


def test_batched_greedy_output_equals_output_alone(conn, redis_url, tiny):
    alone = _run(conn, redis_url, tiny, 1, "alone")
    batched = _run(conn, redis_url, tiny, 4, "batched")
    for cid, record in alone.items():
        got = batched[cid]
        assert got.status == "succeeded", got.error
        assert got.response.choices[0].message.content == record.response.choices[0].message.content
        assert got.response.choices[0].finish_reason == record.response.choices[0].finish_reason
        assert got.response.usage == record.response.usage
    assert max(r.metrics.batch_size for r in batched.values()) > 1
    assert all(r.metrics.batch_size == 1 for r in alone.values())
    assert batched["d"].response.choices[0].finish_reason == "stop"
    assert batched["c"].response.usage.completion_tokens == 5


def test_jobs_that_must_run_alone_are_handed_back_in_order(conn, redis_url, tiny):
    client = Client(connection=conn)
    s = client.submit(
        {
            "b1": chat(tiny.target, max_tokens=6, temperature=0),
            "choices": chat(tiny.target, max_tokens=6, temperature=0.9, n=2),
            "other-model": chat(tiny.twin, max_tokens=6, temperature=0),
            "draft": chat(tiny.target, max_tokens=6, temperature=0, draft_model=tiny.twin),
            "b2": chat(tiny.target, max_tokens=6, temperature=0),
        }
    )
    run_worker(redis_url, runtime=runtime.WorkerRuntime(cache=ModelCache()), max_batch=8)
    records = {r.custom_id: r for r in (read_result(conn, j) for j in s.job_ids)}
    assert all(r.status == "succeeded" for r in records.values())
    assert records["choices"].metrics.batch_size == 3  # its two choices joined b1
    assert records["draft"].metrics.batch_size == 1
    assert records["draft"].metrics.draft_model == tiny.twin
    # b1 stopped claiming at the first job it could not take: FIFO order holds.
    order = sorted(records.values(), key=lambda r: r.finished_at)
    assert {r.custom_id for r in order[:2]} == {"b1", "choices"}


def _text(record) -> str:
    assert record.status == "succeeded", record.error
    return record.response.choices[0].message.content


def test_a_seeded_job_samples_the_same_text_alone_batched_streamed_and_as_choice_0(
    conn, redis_url, tiny
):
    """A seeded sampling job draws from its own key: batched among other jobs (sampled,
    greedy, other seeds), streamed in that batch, alone, and as choice 0 of n = 3 with
    the same seed, it samples the same text; another seed samples another. With a draft
    it still runs alone (its proposals per round would depend on the rows beside it)."""
    client = Client(connection=conn)
    body = chat(tiny.target, max_tokens=12, temperature=0.9, seed=11, logit_bias=NO_EOS)
    batch = client.submit(
        {
            "seeded": body,
            "streamed": body | {"stream": True},
            "other-seed": body | {"seed": 12},
            "greedy": chat(tiny.target, max_tokens=12, temperature=0),
            "unseeded": chat(tiny.target, max_tokens=12, temperature=0.9),
            "drafted": body | {"draft_model": tiny.twin},
        },
        batch_id="seeded-batch",
    )
    run_worker(redis_url, max_batch=8)
    got = {r.custom_id: r for r in (read_result(conn, j) for j in batch.job_ids)}
    alone = client.submit([body], batch_id="seeded-alone")
    choices = client.submit([body | {"n": 3}], batch_id="seeded-n")
    run_worker(redis_url, max_batch=1)
    text = _text(read_result(conn, alone.job_ids[0]))
    assert got["seeded"].metrics.batch_size > 1 and got["streamed"].metrics.batch_size > 1
    assert _text(got["seeded"]) == _text(got["streamed"]) == text
    assert read_result(conn, choices.job_ids[0]).response.choices[0].message.content == text
    assert _text(got["other-seed"]) != text
    assert got["drafted"].metrics.batch_size == 1 and got["drafted"].metrics.draft_model


def test_job_timeout_inside_a_batch(conn, redis_url, tiny):
    from tests.test_faults import slow_job

    client = Client(connection=conn)
    # 8,000 tokens: far more than one second gives on any machine
    s = client.submit([slow_job(tiny, max_tokens=8000)], job_timeout=1)
    quick = client.submit([chat(tiny.slow, max_tokens=3, temperature=0)])
    run_worker(redis_url, runtime=runtime.WorkerRuntime(cache=ModelCache()), max_batch=4)
    record = read_result(conn, s.job_ids[0])
    assert record.status == "failed" and record.error.code == "timeout"
    assert read_result(conn, quick.job_ids[0]).status == "succeeded"


def test_a_surprise_in_the_batch_fails_that_job_and_the_worker_goes_on(
    conn, redis_url, tiny, monkeypatch
):
    from worker.engine.generator import ChatGenerator

    real = ChatGenerator.prepare

    def flaky(self, request, default_num_draft_tokens=3, images=None):
        if request.messages[0].text == "boom":
            raise RuntimeError("tokenizer exploded")
        return real(self, request, default_num_draft_tokens, images)

    monkeypatch.setattr(ChatGenerator, "prepare", flaky)
    client = Client(connection=conn)
    s = client.submit(
        {
            "ok1": chat(tiny.target, max_tokens=4, temperature=0),
            "boom": chat(tiny.target, content="boom", max_tokens=4, temperature=0),
            "ok2": chat(tiny.target, max_tokens=4, temperature=0),
        }
    )
    run_worker(redis_url, max_batch=4)
    records = {r.custom_id: r for r in (read_result(conn, j) for j in s.job_ids)}
    assert records["boom"].status == "failed"
    assert "RuntimeError: tokenizer exploded" in records["boom"].error.message
    assert records["ok1"].status == records["ok2"].status == "succeeded"


def _draft_jobs(tiny, n: int) -> dict[str, dict]:
    return {
        f"j{i}": chat(
            tiny.target,
            content=f"job {i} " + "word " * i,
            max_tokens=10 + i,
            temperature=0,
            draft_model=tiny.draft,
        )
        for i in range(n)
    }


def _seeded_policy(tiny) -> SpeculationPolicy:
    """A policy that has measured the pair one job at a time (plain, k=3, k=6)."""
    from tests.test_policy import synthetic

    policy = SpeculationPolicy("auto", default_k=3)
    for _ in range(3):
        d = policy.choose(tiny.target, tiny.draft)
        policy.record(tiny.target, tiny.draft, d, synthetic(d.k, 0.8))
    return policy


def test_deep_queue_of_draft_jobs_is_batched_when_batching_measures_faster(conn, redis_url, tiny):
    jobs = _draft_jobs(tiny, 6)
    s = Client(connection=conn).submit(jobs, batch_id="spec")
    rt = runtime.WorkerRuntime(cache=ModelCache(), policy=SpeculationPolicy("always"))
    run_worker(redis_url, runtime=rt, max_batch=1)
    alone = {r.custom_id: r for r in (read_result(conn, j) for j in s.job_ids)}
    assert all(r.metrics.speculative and r.metrics.batch_size == 1 for r in alone.values())

    policy = _seeded_policy(tiny)
    rt = runtime.WorkerRuntime(cache=ModelCache(), policy=policy)
    rounds = (
        ("measure", "measuring batching", False),
        ("measure-spec", "measuring speculative batching (k per round, up to 6)", True),
    )
    for round_, reason, speculative in rounds:
        s = Client(connection=conn).submit(jobs, batch_id=round_)
        run_worker(redis_url, runtime=rt, max_batch=4)
        got = {r.custom_id: r for r in (read_result(conn, j) for j in s.job_ids)}
        assert max(r.metrics.batch_size for r in got.values()) > 1
        for cid, r in got.items():
            assert r.status == "succeeded", r.error
            assert r.metrics.speculative == speculative and reason in r.metrics.speculation_reason
            assert r.metrics.draft_model == tiny.draft
            text = r.response.choices[0].message.content
            assert text == alone[cid].response.choices[0].message.content
            if speculative:  # each round's k chosen by the batch, up to 6
                assert r.metrics.num_draft_tokens == 6
                assert r.metrics.draft_tokens_accepted <= r.metrics.draft_tokens_proposed
    # Both batch kinds' aggregate speeds were measured and fed back to the policy.
    assert policy.sizes.plain[(tiny.target, None)].by_size
    assert policy.sizes.spec[(tiny.target, None, tiny.draft, ADAPTIVE)].by_size


def test_deep_queue_of_draft_jobs_speculates_when_batching_measures_slower(conn, redis_url, tiny):
    policy = _seeded_policy(tiny)
    policy.sizes.record(tiny.target, None, 4, tokens=1, seconds=10.0)  # batches crawl
    policy.sizes.record(tiny.target, None, 4, 1, 10.0, draft=tiny.draft, k=6, adaptive=True)
    s = Client(connection=conn).submit(_draft_jobs(tiny, 4))
    run_worker(
        redis_url, runtime=runtime.WorkerRuntime(cache=ModelCache(), policy=policy), max_batch=4
    )
    records = [read_result(conn, j) for j in s.job_ids]
    assert all(r.metrics.batch_size == 1 for r in records)
    assert all(r.metrics.speculative for r in records)


def test_max_jobs_counts_jobs_not_batches(conn, redis_url, tiny):
    jobs = {
        f"j{i}": chat(tiny.target, content=f"n{i}", max_tokens=3, temperature=0) for i in range(6)
    }
    s = Client(connection=conn).submit(jobs)
    run_worker(redis_url, max_batch=4, max_jobs=3)
    ran = [read_result(conn, j) is not None for j in s.job_ids]
    assert ran == [True, True, True, False, False, False]
    assert conn.llen(keys.rq_queue_key("mlxq")) == 3 and conn.hlen(keys.RUNNING) == 0


class _FickleAuto(SpeculationPolicy):
    """auto that batches the first draft job speculatively, then changes its mind."""

    def __init__(self) -> None:
        super().__init__("auto")
        self.asked = 0

    def batch_instead(self, target, draft, adapter, depth, fixed_k=None):
        self.asked += 1
        if fixed_k is not None:
            return super().batch_instead(target, draft, adapter, depth, fixed_k)
        if self.asked == 1:
            return Decision(4, "first: speculative batch", adaptive=True)
        return Decision(PLAIN, "later: plain batch")


def test_a_batch_keeps_its_terms_when_the_policy_changes_its_mind(conn, redis_url, tiny):
    """Draft jobs that leave k to the policy join a running batch on its terms until
    the queue is dry; a job that fixes its k, or names another draft, does not."""
    jobs = _draft_jobs(tiny, 6)
    jobs["fixed"] = jobs["j5"] | {"num_draft_tokens": 2}
    jobs["other"] = jobs["j4"] | {"draft_model": tiny.twin}
    s = Client(connection=conn).submit(jobs, batch_id="fickle")
    policy = _FickleAuto()
    run_worker(
        redis_url, runtime=runtime.WorkerRuntime(cache=ModelCache(), policy=policy), max_batch=8
    )
    got = {r.custom_id: r for r in (read_result(conn, j) for j in s.job_ids)}
    assert all(r.status == "succeeded" for r in got.values())
    for cid in (f"j{i}" for i in range(6)):
        m = got[cid].metrics
        assert m.speculative and m.speculation_reason == "first: speculative batch", cid
        assert m.batch_size > 1
    assert got["fixed"].metrics.num_draft_tokens == 2
    assert "first" not in got["fixed"].metrics.speculation_reason
    assert "first" not in got["other"].metrics.speculation_reason


def test_each_take_routes_the_job_once(conn, redis_url, tiny):
    """The policy is asked about a job once per take (``worker.schedule.route``), whatever
    path it runs: batched, alone with prompt lookup, streamed, n choices; a job handed
    back (it cannot join the running batch) is routed again when taken again."""
    from redis import Redis

    from worker.runner.loop import Worker

    class Counting(SpeculationPolicy):
        asked = chosen = 0

        def proposer(self, req):
            self.asked += 1
            return super().proposer(req)

        def choose(self, *args, **kwargs):
            self.chosen += 1
            return super().choose(*args, **kwargs)

    jobs = {f"p{i}": chat(tiny.target, f"plain {i}", max_tokens=6, temperature=0) for i in range(5)}
    jobs["stream"] = chat(tiny.target, "streamed", max_tokens=6, stream=True)
    jobs["n"] = chat(tiny.target, "two", max_tokens=6, n=2, temperature=0)
    lookup = {"speculation": {"method": "prompt_lookup"}, "temperature": 0}
    jobs["lookup"] = chat(tiny.target, "look up look up", max_tokens=6, **lookup)
    jobs["p5"] = chat(tiny.target, "plain after", max_tokens=6, temperature=0)
    s = Client(connection=conn).submit(jobs, batch_id="routed")
    policy = Counting("auto")
    rt = runtime.WorkerRuntime(cache=ModelCache(), worker_id="routed", policy=policy)
    worker = Worker(Redis.from_url(redis_url), ["mlxq"], rt, name="routed", max_batch=4, burst=True)
    worker.work()
    records = {r.custom_id: r for r in (read_result(conn, j) for j in s.job_ids)}
    assert all(r.status == "succeeded" for r in records.values())
    assert worker.taken > len(jobs)  # some were handed back by the batch and taken again
    assert policy.asked == worker.taken
    assert policy.chosen == 1  # the lookup job, which ran alone, decided once
    assert records["lookup"].metrics.speculation_reason
