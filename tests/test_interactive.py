"""Interactive jobs never wait behind a running batch (``worker.runner.lanes``).

A worker running a long continuous batch from ``mlxq`` looks at ``mlxq.interactive``
between steps: a job there joins the batch (taking the place of a batch job when
it is full), or runs alone between two steps; a preempted batch job goes back to
its queue and ends once, with its greedy text unchanged; a flood of interactive
jobs cannot stop the batch.
"""

from __future__ import annotations

import itertools
import re
import signal
import threading

import pytest
from redis import Redis

from producer import Client
from producer.metrics import _worker_metrics
from schemas import ChatRequest, keys
from schemas.fleet import Histogram, WorkerInfo
from schemas.store import read_result
from tests.conftest import chat, run_jobs, run_worker
from tests.waiting import seconds, wait_for
from worker.dev.tinymodels import TinySpec, ensure_model
from worker.engine import prompt_tokens
from worker.engine.batch import BatchEngine
from worker.engine.generator import ChatGenerator
from worker.engine.models import ModelCache
from worker.engine.specbatch import SpecBatchEngine
from worker.runner import runtime
from worker.schedule.admission import batch_peak_bytes
from worker.schedule.policy import SpeculationPolicy
from worker.schedule.step import StepConfig

QUEUES = (keys.INTERACTIVE_QUEUE, keys.DEFAULT_QUEUE)
EOS_OFF = {"3": -100}  # the tiny tokenizer's EOS: jobs run to max_tokens


def _batch(conn, model: str, n: int, tokens: int, tag: str = "b", **fields) -> list[str]:
    jobs = {
        f"{tag}{i}": chat(model, f"batch job {i}", max_tokens=tokens, temperature=0, **fields)
        for i in range(n)
    }
    return Client(connection=conn).submit(jobs, batch_id=tag).job_ids


def _long_batch(conn, model: str, n: int) -> list[str]:
    """``n`` batch jobs that run until cancelled (EOS barred; thousands of tokens on
    ``tiny.slow``): what runs beside them ends first by construction, not by timing."""
    bodies = {
        f"l{i}": chat(model, f"long {i}", max_tokens=6000, logit_bias=EOS_OFF) for i in range(n)
    }
    return Client(connection=conn).submit(bodies, batch_id="long").job_ids


def _interactive(
    conn, model: str, count: int, tag: str = "i", tenant: str = keys.DEFAULT_TENANT, **fields
) -> list[str]:
    jobs = {
        f"{tag}{i}": chat(model, f"question {i}", **({"max_tokens": 8, "temperature": 0} | fields))
        for i in range(count)
    }
    client = Client(connection=conn, queue=keys.INTERACTIVE_QUEUE)
    return client.submit(jobs, batch_id=tag, tenant=tenant).job_ids


def _serve(redis_url: str, rt: runtime.WorkerRuntime, max_batch: int | None) -> threading.Thread:
    t = threading.Thread(
        target=run_worker,
        args=(redis_url,),
        kwargs={"queues": QUEUES, "runtime": rt, "max_batch": max_batch},
        daemon=True,
    )
    t.start()
    return t


def _ended(conn: Redis, ids: list[str]) -> int:
    return sum(conn.exists(keys.result_key(j)) for j in ids)


def _wait(cond, timeout: float = 120.0) -> None:
    wait_for(cond, timeout)


def _rt(
    policy: SpeculationPolicy | None = None, join: str = "auto", **step: float
) -> runtime.WorkerRuntime:
    """(``join``: ``worker --interactive-join``; ``step``: other ``StepConfig`` fields.)"""
    return runtime.WorkerRuntime(
        cache=ModelCache(),
        policy=policy or SpeculationPolicy("never"),
        step=StepConfig(join_mode=join, **step),
    )


@pytest.mark.parametrize(
    ("stream", "tenant"),
    [(False, keys.DEFAULT_TENANT), (True, keys.DEFAULT_TENANT), (False, "app")],
)
def test_interactive_jobs_end_while_the_batch_runs(conn, redis_url, tiny, stream, tenant):
    """(``tenant``: on a tenant's list of the interactive queue, as a gateway key's.)"""
    batch = _batch(conn, tiny.target, 300, 24)
    rt = _rt()
    worker = _serve(redis_url, rt, max_batch=8)
    _wait(lambda: _ended(conn, batch) >= 8)  # the batch is running
    asked = _interactive(conn, tiny.target, 4, stream=stream, tenant=tenant)
    at_ask = _ended(conn, batch)
    _wait(lambda: _ended(conn, asked) == 4)
    during = _ended(conn, batch) - at_ask
    # before, they waited for the batch queue to drain (~290 jobs); now a few steps
    assert during <= 40, during
    assert all(read_result(conn, j).status == "succeeded" for j in asked)
    worker.join(seconds(180))
    assert _ended(conn, batch) == 300
    # latencies per queue (Prometheus: mlxq_*_by_queue_seconds{worker,queue})
    waits = {q: h["queue_wait"].count for q, h in rt.stats.by_queue.items()}
    assert waits == {keys.INTERACTIVE_QUEUE: 4, keys.DEFAULT_QUEUE: 300}


def _alone_texts(conn, redis_url, model: str, asks: list[tuple[str, int]], **fields) -> list[str]:
    """The greedy text of (prompt, max_tokens) jobs, each run alone by a fresh worker
    (the reference)."""
    jobs = {
        f"ref{i}": chat(model, prompt, max_tokens=tokens, temperature=0, **fields)
        for i, (prompt, tokens) in enumerate(asks)
    }
    s = Client(connection=conn).submit(jobs, batch_id="ref")
    run_worker(redis_url, runtime=_rt(), max_batch=1)
    return _texts(conn, s.job_ids)


def _asks(prompt: str, n: int, tokens: int) -> list[tuple[str, int]]:
    """What ``_batch`` (``prompt`` "batch job") and ``_interactive`` ("question") send."""
    return [(f"{prompt} {i}", tokens) for i in range(n)]


@pytest.fixture(scope="module")
def archs(tmp_path_factory) -> dict[str, str]:
    """A sliding-window model (Gemma 3's shape) and a linear-attention hybrid (Qwen3.5's)."""
    root = tmp_path_factory.mktemp("archs")
    shapes = {"sliding": "gemma3_text", "hybrid": "qwen3_5"}
    return {
        kind: str(ensure_model(root / kind, TinySpec(arch=arch, layers=4, window=8, seed=21)))
        for kind, arch in shapes.items()
    }


@pytest.mark.parametrize("kind", ["plain", "draft", "lookup", "sliding", "hybrid"])
def test_a_full_batch_preempts_a_batch_job_which_ends_once_unchanged(
    conn, redis_url, tiny, archs, kind
):
    model = archs.get(kind, tiny.target)
    fields = {
        "draft": {"draft_model": tiny.draft, "num_draft_tokens": 3},
        "lookup": {"speculation": {"method": "prompt_lookup", "num_tokens": 3}},
    }.get(kind, {})
    policy = SpeculationPolicy("always" if kind in ("draft", "lookup") else "never")
    batch = _batch(conn, model, 12, 160, **fields)
    rt = _rt(policy, join="always")  # (as on a GPU, where the measured rule joins)
    worker = _serve(redis_url, rt, max_batch=4)
    _wait(lambda: conn.hlen(keys.RUNNING) >= 4)  # the batch is full
    asked = _interactive(conn, model, 3, **fields)  # the same kind: they can join
    _wait(lambda: _ended(conn, asked) == 3)
    worker.join(seconds(120))
    assert rt.stats.preemptions >= 1
    records = [read_result(conn, j) for j in batch]
    assert all(r.status == "succeeded" for r in records)
    texts = [r.response.choices[0].message.content for r in records]
    assert texts == _alone_texts(conn, redis_url, model, _asks("batch job", 12, 160), **fields)
    # each ended once: the batch counted each once
    assert int(conn.hget(keys.batch_key("b"), "succeeded")) == 12


def test_a_side_batch_reserves_its_kv_room_beside_the_batch(conn, redis_url, tiny, monkeypatch):
    """While a side batch runs, the model cache holds room for both batches' KV caches
    (kept prefixes keep out of it); once it ends, the batch's alone again."""
    from worker.runner import lane as lanes

    seen: list[tuple[str, int, int, int]] = []  # (lane, reserved, the batch's, the side's)
    step = lanes.Lane.step

    live: dict[str, lanes.Lane] = {}  # the last lane of each kind seen stepping

    def stepped(self, *args):
        kind = "side" if self.queue == keys.INTERACTIVE_QUEUE else "main"
        live[kind] = self

        def grows(k: str) -> int:  # what that lane's caches can grow to, while it lives
            lane = live.get(k)
            return lane.projected if lane is not None and lane in self.ledger.held else 0

        seen.append((kind, self.rt.cache.kv_reserved, grows("main"), grows("side")))
        return step(self, *args)

    monkeypatch.setattr(lanes.Lane, "step", stepped)
    batch = _long_batch(conn, tiny.slow, 4)
    worker = _serve(redis_url, _rt(join="never"), max_batch=4)
    _wait(lambda: conn.hlen(keys.RUNNING) >= 4)
    asked = _interactive(conn, tiny.slow, 2)
    _wait(lambda: _ended(conn, asked) == 2)
    assert _ended(conn, batch) == 0
    Client(connection=conn).cancel("long")  # (the running batch stops at its next step)
    worker.join(seconds(120))
    assert _ended(conn, batch) == 4
    assert all(reserved == mine + side for _, reserved, mine, side in seen)
    sides = [side for kind, _, _, side in seen if kind == "side"]
    assert sides and min(sides) > 0  # the side's room was reserved
    assert seen[-1][0] == "main" and seen[-1][3] == 0  # and given back once it ended


@pytest.mark.parametrize("stream", [True, False])
def test_a_flood_of_interactive_jobs_cannot_stop_the_batch(conn, redis_url, tiny, stream):
    """(They join, or run in a side batch beside it; ``stream``: streamed, batched alike.)
    The floor is of time (a quarter of it, once the bank the batch saved while none
    waited is spent: made small here, or this tiny model's flood would run on it)."""
    batch = _batch(conn, tiny.target, 40, 12)
    worker = _serve(redis_url, _rt(floor_credit_s=0.05), max_batch=4)
    _wait(lambda: _ended(conn, batch) >= 1)
    flood = _interactive(conn, tiny.target, 60, stream=stream)
    _wait(lambda: _ended(conn, flood) >= 10)
    early = _ended(conn, batch)
    assert early < 40  # the flood did not wait for the batch
    _wait(lambda: _ended(conn, flood) >= 50)
    assert _ended(conn, batch) > early  # and the batch went on during the flood
    worker.join(seconds(180))
    assert _ended(conn, flood) == 60 and _ended(conn, batch) == 40


def test_jobs_run_alone_go_back_to_back_while_the_batch_is_owed_nothing(
    conn, redis_url, tiny, monkeypatch
):
    """Jobs the batch cannot hold run alone one after another while the batch has banked
    step time (each owes a third of what it took); they wait for a step only once they
    have used it up. (No side lane here: with one, such jobs step in solo lanes.)"""
    from worker.engine.batch import BatchEngine
    from worker.runner.loop import Worker

    events: list[str] = []
    step, alone = BatchEngine.step, Worker.run_alone
    inside = threading.Event()  # (steps of an engine of a job alone are not the batch's)

    def stepped(self):
        if not inside.is_set():
            events.append("s")
        return step(self)

    def ran(self, job, r):
        events.append("a")
        inside.set()
        try:
            return alone(self, job, r)
        finally:
            inside.clear()

    monkeypatch.setattr(BatchEngine, "step", stepped)
    monkeypatch.setattr(Worker, "run_alone", ran)
    batch = _batch(conn, tiny.target, 12, 160)
    worker = _serve(redis_url, _rt(side_lanes=0), max_batch=4)
    _wait(lambda: _ended(conn, batch) >= 1)  # a batch job's 160 steps: the bank is full
    solo = {"temperature": 0.9, "seed": 1, "speculation": {"method": "prompt_lookup"}}
    asked = _interactive(conn, tiny.target, 3, **solo)  # seeded and proposing: alone
    _wait(lambda: _ended(conn, asked) == 3)
    worker.join(seconds(120))
    runs = "".join(events)
    assert runs.count("a") == 3 and "aaa" in runs, runs[-40:]


@pytest.mark.parametrize("kind", ["lookup", "sliding", "hybrid", "draft"])
def test_jobs_that_cannot_share_a_batch_step_in_solo_lanes_beside_it(
    conn, redis_url, tiny, archs, monkeypatch, kind
):
    """Jobs ahead that cannot be batched (one sampled choice with a seed and a draft or
    prompt lookup; the second streamed) run in solo lanes, first come first served,
    stepped in turn with the batch, which goes on decoding while they run (before, each
    ran to its end between two of the batch's steps); each samples its text alone. On
    full, sliding-window and hybrid caches."""
    events: list[str] = []
    solos: list[SpecBatchEngine] = []  # the solo engines, in the order they stepped
    plain, spec = BatchEngine.step, SpecBatchEngine.step

    def batch_step(self):
        events.append("s")
        return plain(self)

    def solo_step(self):
        if not any(e is self for e in solos):
            solos.append(self)
        events.append("ab"[next(i for i, e in enumerate(solos) if e is self)])
        return spec(self)

    monkeypatch.setattr(BatchEngine, "step", batch_step)
    monkeypatch.setattr(SpecBatchEngine, "step", solo_step)
    model = {"draft": tiny.target, "lookup": tiny.slow}.get(kind) or archs[kind]
    proposer = (
        {"draft_model": tiny.draft, "num_draft_tokens": 3}
        if kind == "draft"
        else {"speculation": {"method": "prompt_lookup"}}
    )
    batch = _long_batch(conn, tiny.slow, 2)
    rt = _rt(SpeculationPolicy("always"), join="never", floor_credit_s=0.0)
    for m in (model, tiny.draft):
        rt.cache.get(m)  # (a job runs beside the batch only on models that are loaded)
    worker = _serve(redis_url, rt, max_batch=4)
    _wait(lambda: conn.hlen(keys.RUNNING) >= 2)
    jobs = {
        f"o{i}": chat(
            model, f"say it again {i}", max_tokens=24, seed=i, temperature=0.9, stream=i == 1
        )
        | proposer
        for i in range(2)
    }
    asked = Client(connection=conn, queue=keys.INTERACTIVE_QUEUE).submit(jobs, batch_id="o")
    _wait(lambda: _ended(conn, asked.job_ids) == 2)
    assert _ended(conn, batch) == 0
    Client(connection=conn).cancel("long")
    worker.join(seconds(120))
    runs = "".join(events)
    assert re.search("a+s+a", runs), runs  # the batch stepped while the first ran
    assert re.fullmatch("a+b+", runs.replace("s", "")), runs  # one after the other
    records = [read_result(conn, j) for j in asked.job_ids]
    method = "draft" if kind == "draft" else "prompt_lookup"
    assert [r.metrics.speculation_method for r in records] == [method] * 2, records
    monkeypatch.undo()
    alone = run_jobs(conn, redis_url, jobs, "alone", policy=SpeculationPolicy("always"))
    assert _texts(conn, asked.job_ids) == [_texts(conn, [alone[c].job_id])[0] for c in jobs]


def test_a_job_cancelled_in_its_solo_lane_ends_once_with_its_text_so_far(conn, redis_url, tiny):
    """A solo lane's job stops at its next step when its batch is cancelled: one
    ``cancelled`` record holding what it made; the batch beside it runs on."""
    batch = _long_batch(conn, tiny.slow, 2)
    worker = _serve(redis_url, _rt(SpeculationPolicy("always"), join="never"), max_batch=4)
    _wait(lambda: conn.hlen(keys.RUNNING) >= 2)
    body = chat(tiny.slow, "go on", max_tokens=6000, seed=1, temperature=0.9, logit_bias=EOS_OFF)
    body["speculation"] = {"method": "prompt_lookup"}
    client = Client(connection=conn, queue=keys.INTERACTIVE_QUEUE)
    solo = client.submit({"o": body}, batch_id="o").job_ids[0]
    _wait(lambda: conn.hexists(keys.RUNNING, solo))
    client.cancel("o")
    _wait(lambda: _ended(conn, [solo]) == 1)
    record = read_result(conn, solo)
    assert record.status == "cancelled" and record.partial
    assert _ended(conn, batch) == 0  # (the batch ran on)
    Client(connection=conn).cancel("long")
    worker.join(seconds(120))
    assert int(conn.hget(keys.batch_key("o"), "cancelled") or 0) == 1


@pytest.mark.parametrize(
    ("path", "kind"),
    [("join", "plain"), ("alone", "plain"), ("join", "sliding"), ("join", "hybrid")],
)
def test_batch_jobs_give_their_memory_up_for_an_interactive_job(
    conn, redis_url, tiny, archs, path, kind
):
    """A batch at its memory budget (four of its jobs fit, not five): an interactive job
    of the same size joins it (``join``) or runs on its own beside it (``alone``: sampled
    with a seed, by prompt lookup: a solo lane)
    once the batch jobs that joined last give their places up (as few as free enough:
    a batch's rows are as long as its longest), back to the front of their queue
    unstarted; they end once, their text unchanged. Before, the request waited for
    memory to free (or, alone, for the batch to end)."""
    model = archs.get(kind, tiny.target)
    cache = ModelCache(prefix_bytes=0)
    entry = cache.get(model)[0]
    body = chat(model, "batch job 0", max_tokens=128, temperature=0, logit_bias=EOS_OFF)
    prompt = len(prompt_tokens(entry.tokenizer, ChatRequest.model_validate(body)))
    one = batch_peak_bytes(entry.kv, [(prompt + 8, 128)])
    cache.budget_bytes = entry.nbytes + 4 * one + one // 2
    batch = _batch(conn, model, 8, 128, logit_bias=EOS_OFF)
    rt = runtime.WorkerRuntime(cache=cache, policy=SpeculationPolicy("never"), step=StepConfig())
    worker = _serve(redis_url, rt, max_batch=8)
    _wait(lambda: conn.hlen(keys.RUNNING) >= 4)  # the batch is at its budget
    ask = chat(model, "question 0", max_tokens=128, temperature=0, logit_bias=EOS_OFF)
    client = Client(connection=conn, queue=keys.INTERACTIVE_QUEUE)
    lookup = {"temperature": 0.9, "seed": 1, "speculation": {"method": "prompt_lookup"}}
    extra = lookup if path == "alone" else {}  # (seeded and proposing: a solo lane)
    asked = client.submit({"i0": ask | extra}, batch_id="i").job_ids
    _wait(lambda: _ended(conn, asked) == 1)
    worker.join(seconds(180))
    assert rt.stats.preemptions >= 1
    mine = read_result(conn, asked[0])
    records = [read_result(conn, j) for j in batch]
    assert mine.status == "succeeded" and all(r.status == "succeeded" for r in records)
    assert mine.finished_at < max(r.finished_at for r in records)
    assert rt.stats.peak_projected_kv_bytes <= 4 * one + one // 2
    texts = [r.response.choices[0].message.content for r in records]
    asks = _asks("batch job", 8, 128)
    assert texts == _alone_texts(conn, redis_url, model, asks, logit_bias=EOS_OFF)
    assert int(conn.hget(keys.batch_key("b"), "succeeded")) == 8  # each ended once


def test_sigkill_while_preempting_loses_nothing(conn, redis_url, tiny, workers):
    # interactive jobs join (as on a GPU, where the measured rule joins): at the cap of 4
    # each takes a batch job's place
    args = ("--lease-seconds", "2", "--max-batch", "4", "--speculative", "never")
    a = workers(*args, "--interactive-join", "always", name="a")
    batch = _batch(conn, tiny.slow, 8, 200)
    _wait(lambda: conn.hlen(keys.RUNNING) >= 4)
    asked = _interactive(conn, tiny.slow, 4)

    def preempted_or_over() -> bool:  # (over without one: fail now, not after a window)
        return "preempted" in a.output or _ended(conn, batch + asked) == 12

    _wait(preempted_or_over, 60)
    assert "preempted for a job ahead" in a.output, a.output
    a.signal(signal.SIGKILL)
    a.wait()
    b = workers(*args, name="b")
    # a's jobs are recovered when its lease ends
    _wait(lambda: _ended(conn, batch + asked) == 12, 240)
    b.signal(signal.SIGTERM)
    assert b.wait(60) == 0
    records = [read_result(conn, j) for j in batch + asked]
    assert all(r is not None and r.status == "succeeded" for r in records)
    assert int(conn.hget(keys.batch_key("b"), "succeeded")) == 8  # each ended once
    assert int(conn.hget(keys.batch_key("i"), "succeeded")) == 4


def test_preemptions_and_latencies_per_queue_are_exported():
    wait = Histogram()
    wait.observe(0.05)
    info = WorkerInfo(
        name="w",
        host="h",
        pid=1,
        queues=list(QUEUES),
        state="busy",
        updated_at=0.0,
        preemptions=3,
        queue_latency={keys.INTERACTIVE_QUEUE: {"queue_wait": wait}},
    )
    families = {f.name: f for f in _worker_metrics([info], {})}
    assert [s.value for s in families["mlxq_worker_preemptions"].samples] == [3]
    counts = [
        s for s in families["mlxq_queue_wait_by_queue_seconds"].samples if s.name.endswith("_count")
    ]
    assert [(s.labels["queue"], s.value) for s in counts] == [(keys.INTERACTIVE_QUEUE, 1)]


@pytest.mark.parametrize("first", [True, False])
def test_an_interactive_prompt_prefills_before_batch_prompts_still_waiting(tiny, first):
    cache = ModelCache()
    gen = ChatGenerator.get_or_create(tiny.target, cache=cache)
    engine = BatchEngine(gen.target, max_batch=1)  # one at a time: the order shows
    for tag in ("a", "b"):
        engine.add(tag, gen.prepare(ChatRequest.model_validate(chat(tiny.target, "x " * 200))))
    engine.add("urgent", gen.prepare(ChatRequest.model_validate(chat(tiny.target))), first=first)
    while engine.first_token_at("urgent") is None and engine.first_token_at("a") is None:
        engine.step()
    assert (engine.first_token_at("urgent") is not None) == first
    engine.close()


def test_when_a_batch_step_costs_many_single_steps_interactive_jobs_run_beside_it(
    conn, redis_url, tiny
):
    rt = _rt()
    # as measured on a compute-bound device: one sequence alone decodes far faster than
    # a step of the running batch (here 10^6 tokens/s: any real step is slower)
    rt.policy.sizes.record(tiny.target, None, 1, 1000, 1e-3)
    batch = _batch(conn, tiny.target, 12, 160)
    worker = _serve(redis_url, rt, max_batch=4)
    # the batch's steps of 4 are measured (16 of them): a join is judged on them
    _wait(lambda: 4 in rt.policy.sizes.plain[(tiny.target, None)].by_size)
    asked = _interactive(conn, tiny.target, 3)
    _wait(lambda: _ended(conn, asked) == 3)
    assert _ended(conn, batch) < 12  # they did not wait for the batch
    worker.join(seconds(120))
    assert rt.stats.preemptions == 0  # nor joined it: they ran beside it, together
    assert [read_result(conn, j).metrics.batch_size for j in asked] == [3, 3, 3]


@pytest.mark.parametrize("measured", ["cheap", "nothing"])
def test_interactive_jobs_join_where_a_step_measured_cheap_else_run_beside(
    conn, redis_url, tiny, measured
):
    """A batch step measured at most twice a single one (a GPU): they join the batch.
    Nothing measured yet: they run beside it, where the side batch measures small sizes."""
    rt = _rt()
    if measured == "cheap":  # one sequence alone measured slower than any real step
        rt.policy.sizes.record(tiny.target, None, 1, 1, 100.0)
    batch = _batch(conn, tiny.target, 4, 160)
    worker = _serve(redis_url, rt, max_batch=8)
    _wait(lambda: conn.hlen(keys.RUNNING) >= 4)
    asked = _interactive(conn, tiny.target, 2)
    _wait(lambda: _ended(conn, asked) == 2)
    assert _ended(conn, batch) < 4
    worker.join(seconds(120))
    sizes = [read_result(conn, j).metrics.batch_size for j in asked]
    assert min(sizes) >= 5 if measured == "cheap" else sizes == [2, 2], sizes


def _texts(conn, ids: list[str]) -> list[str]:
    return [read_result(conn, j).response.choices[0].message.content for j in ids]


@pytest.mark.parametrize("kind", ["plain", "draft", "lookup", "sliding", "hybrid"])
def test_interactive_jobs_batched_beside_the_batch_end_with_their_text_alone(
    conn, redis_url, tiny, archs, kind
):
    """Jobs that cannot join run together in a side batch stepped between the batch's
    steps (its own engine and KV caches): every job's greedy text is its text alone."""
    model = archs.get(kind, tiny.target)
    fields = {
        "draft": {"draft_model": tiny.draft, "num_draft_tokens": 3},
        "lookup": {"speculation": {"method": "prompt_lookup", "num_tokens": 3}},
    }.get(kind, {})
    policy = SpeculationPolicy("always" if kind in ("draft", "lookup") else "never")
    batch = _batch(conn, model, 8, 96, **fields)
    rt = _rt(policy, join="never")
    worker = _serve(redis_url, rt, max_batch=4)
    _wait(lambda: conn.hlen(keys.RUNNING) >= 4)
    asked = _interactive(conn, model, 3, **fields)
    _wait(lambda: _ended(conn, asked) == 3)
    assert _ended(conn, batch) < 8
    worker.join(seconds(120))
    assert [read_result(conn, j).metrics.batch_size for j in asked] == [3, 3, 3]
    assert rt.stats.preemptions == 0
    asks = _asks("question", 3, 8) + _asks("batch job", 8, 96)
    alone = _alone_texts(conn, redis_url, model, asks, **fields)
    assert _texts(conn, asked) + _texts(conn, batch) == alone


def test_jobs_ahead_for_two_other_models_run_in_a_side_lane_each(conn, redis_url, tiny):
    """Jobs ahead for two other loaded models (they cannot join the batch) are batched in
    a side lane per model, stepped in turn beside the batch: each ends with its text
    alone, before the batch does."""
    rt, models = _rt(join="never"), (tiny.twin, tiny.draft)
    for m in models:
        rt.cache.get(m)  # (a side lane runs only on a model that is loaded)
    batch = _long_batch(conn, tiny.slow, 4)
    worker = _serve(redis_url, rt, max_batch=4)
    _wait(lambda: conn.hlen(keys.RUNNING) >= 4)
    jobs = {
        f"{m}{i}": chat(model, f"question {i}", max_tokens=8, temperature=0)
        for m, model in zip("td", models, strict=True)
        for i in range(2)
    }
    asked = Client(connection=conn, queue=keys.INTERACTIVE_QUEUE).submit(jobs, batch_id="i")
    _wait(lambda: _ended(conn, asked.job_ids) == 4)
    assert _ended(conn, batch) == 0
    Client(connection=conn).cancel("long")  # (the running batch stops at its next step)
    worker.join(seconds(120))
    assert [read_result(conn, j).metrics.batch_size for j in asked.job_ids] == [2, 2, 2, 2]
    alone = run_jobs(conn, redis_url, jobs, "alone")  # one at a time, a fresh worker
    assert _texts(conn, asked.job_ids) == [_texts(conn, [alone[c].job_id])[0] for c in jobs]


def test_a_batch_queue_job_for_another_loaded_model_runs_beside_the_batch(conn, redis_url, tiny):
    """Jobs of the batch's own queue for another loaded model, behind the batch's jobs
    (its model's are taken first), run in that model's side lane once the queue holds
    nothing more for the batch: they end before the batch does, with their text alone.
    Before, they went back to the queue until the batch ended."""
    rt = _rt(join="never")
    rt.cache.get(tiny.twin)  # (a side lane runs only on a model that is loaded)
    batch = _long_batch(conn, tiny.slow, 3)  # (a place free: the lane takes more)
    jobs = {f"t{i}": chat(tiny.twin, f"question {i}", max_tokens=8, temperature=0) for i in "01"}
    other = Client(connection=conn).submit(jobs, batch_id="t").job_ids
    worker = _serve(redis_url, rt, max_batch=4)
    _wait(lambda: _ended(conn, other) == 2)
    assert _ended(conn, batch) == 0
    Client(connection=conn).cancel("long")  # (the running batch stops at its next step)
    worker.join(seconds(120))
    assert [read_result(conn, j).metrics.batch_size for j in other] == [2, 2]
    alone = run_jobs(conn, redis_url, jobs, "alone")  # one at a time, a fresh worker
    assert _texts(conn, other) == [_texts(conn, [alone[c].job_id])[0] for c in jobs]


def test_jobs_the_batch_cannot_hold_run_between_its_steps_or_wait_for_its_end(
    conn, redis_url, tiny
):
    batch = _batch(conn, tiny.target, 60, 48)
    worker = _serve(redis_url, _rt(), max_batch=4)
    _wait(lambda: _ended(conn, batch) >= 1)
    choices = _interactive(conn, tiny.target, 1, tag="n", n=2)  # it joins or runs beside
    other = _interactive(conn, tiny.draft, 1, tag="o")  # a model not loaded: it waits
    _wait(lambda: _ended(conn, choices) == 1)
    assert _ended(conn, batch) < 60  # ran between two steps
    assert len(read_result(conn, choices[0]).response.choices) == 2
    worker.join(seconds(180))
    waited = read_result(conn, other[0])
    assert waited.status == "succeeded"  # not lost: it ran once the batch had ended
    assert waited.finished_at >= max(read_result(conn, j).finished_at for j in batch)


def _prefill_steps(
    gen: ChatGenerator, budget: float | None, spec: str | None = None
) -> tuple[int, int, list[int], list]:
    """Three ~300-token prompts in one engine under a budget of ``budget`` seconds, turned
    into tokens before each step at the speed the engine measured, as the step plan does
    (``spec``: a speculative batch, by "draft" or prompt "lookup"): the steps that
    prefilled, the engine's estimate of them before the first, the tokens left to prefill
    after each step, and the greedy texts."""
    tokens = None if budget is None else 0  # (the least chunks until a speed is measured)
    if spec is None:
        engine: BatchEngine | SpecBatchEngine = BatchEngine(gen.target, 8, prefill_budget=tokens)
    else:
        engine = SpecBatchEngine(gen.target, gen.draft, 3, prefill_budget=tokens)
    fields = {"speculation": {"method": "prompt_lookup", "num_tokens": 3}} if spec else {}
    for i in range(3):
        prompt = f"{i} " + "tell me about queues and workers " * 20
        body = chat(gen.target.name, prompt, max_tokens=6, temperature=0, **fields)
        engine.add(i, gen.prepare(ChatRequest.model_validate(body)))
    prefills, left, texts = 0, [engine.prefilling], {}
    estimate = engine.prefill_steps
    while len(engine):
        if budget is not None:
            engine.prefill_budget = int(budget * (engine.prefill_rate or 0.0))
        step = engine.step()
        prefills += step.prefilled
        left.append(engine.prefilling)
        texts.update({tag: out.text for tag, out in step.done})
    engine.close()
    return prefills, estimate, left, [texts[i] for i in range(3)]


@pytest.mark.parametrize(
    ("kind", "spec"),
    [
        *[(kind, None) for kind in ("plain", "sliding", "hybrid")],
        *[(kind, "draft") for kind in ("plain", "sliding", "hybrid")],
        ("plain", "lookup"),
    ],
)
def test_a_prefill_budget_cuts_prompts_into_short_steps_with_the_same_text(tiny, archs, kind, spec):
    """Under a budget a CPU cannot meet, each step prefills the least chunk per sequence
    (so a job waiting for the next step waits one short step); a budget any device meets
    keeps whole chunks once the speed is measured. The greedy text is the same. A
    speculative batch (``spec``) prefills a chunk of each joining row per round."""
    from worker.engine.batch import MIN_CHUNK

    model = archs.get(kind, tiny.target)
    draft = tiny.draft if spec == "draft" and kind == "plain" else None
    draft = model if spec == "draft" and kind != "plain" else draft  # (itself: same shape)
    gen = ChatGenerator.get_or_create(model, draft, cache=ModelCache())
    whole, whole_estimate, whole_left, whole_texts = _prefill_steps(gen, None, spec)
    cut, cut_estimate, cut_left, cut_texts = _prefill_steps(gen, 1e-9, spec)
    roomy, _, _, roomy_texts = _prefill_steps(gen, 1e9, spec)
    prompt = whole_left[0] // 3
    assert prompt > 250 and whole <= 2 and roomy <= 3  # (the first step: the least chunk)
    assert cut >= prompt // MIN_CHUNK  # every step MIN_CHUNK tokens a sequence
    # what a joiner is judged by (a plain batch: +1, the step that feeds each prompt's
    # last token; a speculative one feeds it in its first round)
    last = 0 if spec else 1
    assert whole == whole_estimate + last and abs(cut - cut_estimate - last) <= 1
    drops = [a - b for a, b in itertools.pairwise(cut_left) if a > b]
    assert max(drops) <= 3 * MIN_CHUNK and cut_left[-1] == 0
    assert cut_texts == whole_texts == roomy_texts


@pytest.mark.parametrize("kind", ["plain", "draft", "lookup"])
def test_an_interactive_job_does_not_join_while_batch_prompts_prefill(conn, redis_url, tiny, kind):
    """It does not join a batch whose steps carry other prompts' chunks: each of its
    tokens would wait for them (seen on a CPU: 94 s to a first token). A speculative
    batch's joiners prefill in chunks too."""
    fields = {
        "draft": {"draft_model": tiny.draft, "num_draft_tokens": 3},
        "lookup": {"speculation": {"method": "prompt_lookup", "num_tokens": 3}},
    }.get(kind, {})
    # (the draft's tokenizer is the target's, whose context is shorter: ~130 tokens)
    model = tiny.target if kind == "draft" else tiny.slow
    long = "tell me about queues and workers " * (20 if kind == "draft" else 40)
    jobs = {
        f"b{i}": chat(model, f"{i} {long}", max_tokens=8, temperature=0, **fields) for i in range(4)
    }
    batch = Client(connection=conn).submit(jobs, batch_id="b").job_ids
    policy = SpeculationPolicy("always" if fields else "never")
    rt = _rt(policy, prefill_budget_s=1e-9, quiet_budget_s=1e-9)  # chunks of MIN_CHUNK
    worker = _serve(redis_url, rt, max_batch=4)
    _wait(lambda: conn.hlen(keys.RUNNING) >= 4)
    asked = _interactive(conn, model, 1, **fields)
    _wait(lambda: _ended(conn, asked) == 1)
    assert _ended(conn, batch) == 0  # the batch's prompts were still prefilling
    worker.join(seconds(180))
    assert read_result(conn, asked[0]).metrics.batch_size == 1  # beside the batch, alone
    assert rt.stats.preemptions == 0
    assert _ended(conn, batch) == 4


def test_jobs_run_between_chunks_of_a_shared_prefix_prefilled_to_keep(
    conn, redis_url, tiny, monkeypatch
):
    """A batch whose jobs share a long prefix prefills it once, to keep, as its first job
    joins (seen on a CPU: a minute for 2,000 tokens): a job waiting on the interactive
    queue meanwhile runs (in a side batch) between two of its chunks, not after it."""
    from worker.engine import prefill
    from worker.runner import lanes
    from worker.runner.loop import Worker

    monkeypatch.setattr(prefill, "PREFILL_STEP", 16)  # the shared prefix: ~40 chunks
    events: list[str] = []
    asked_now = threading.Event()
    add, finish = BatchEngine.add, Worker.finish
    between = lanes.Lanes._between_chunks

    def added(self, tag, *args, **kw):
        events.append(f"add {tag}")
        return add(self, tag, *args, **kw)

    def ended(self, jobs):
        events.extend(f"end {job.id}" for job, _ in jobs)
        return finish(self, jobs)

    def chunked(self):
        events.append("chunk")
        asked_now.wait(seconds(30))  # (the test's clock: the interactive job is queued by now)
        return between(self)

    monkeypatch.setattr(BatchEngine, "add", added)
    monkeypatch.setattr(Worker, "finish", ended)
    monkeypatch.setattr(lanes.Lanes, "_between_chunks", chunked)
    shared = "tell me about queues and workers " * 100
    jobs = {
        f"b{i}": chat(tiny.slow, f"{shared} question {i}", max_tokens=4, temperature=0)
        for i in range(4)
    }
    batch = Client(connection=conn).submit(jobs, batch_id="b").job_ids
    worker = _serve(redis_url, _rt(), max_batch=4)
    _wait(lambda: "chunk" in events)  # the first job joins
    asked = _interactive(conn, tiny.slow, 1)
    asked_now.set()
    _wait(lambda: _ended(conn, asked + batch) == 5)
    worker.join(seconds(120))
    # it ended before the batch began (its first job still prefilling its prefix)
    assert events.index(f"end {asked[0]}") < events.index(f"add {batch[0]}"), events[:8]
    assert events.index(f"end {asked[0]}") < len(events) - events[::-1].index("chunk") - 1
    assert read_result(conn, asked[0]).metrics.batch_size == 1
    records = [read_result(conn, j) for j in batch]
    assert all(r.status == "succeeded" for r in records)
    # the prefix was still kept once and reused by the rest
    assert all(r.response.usage.prompt_tokens_details.cached_tokens > 400 for r in records[1:])
