"""Model-affine taking (``schemas/lua/affine.lua``): jobs for the models a worker holds
come first, within a bound on how long a job for another model is passed over.

The take script on real Redis: a worker holding model ``a`` takes a queue alternating
``a`` and ``b`` as all its ``a`` jobs (in order), then the ``b`` ones (in order); a
head older than the bound, a bound of 0, the interactive queue and a hash without a
model are taken in order; tenants still take turns. End to end: a queue alternating
two models with room for one loads each at most twice, where in order it loads one per
job, and every text is the job's own alone.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from producer import Client
from schemas import ChatRequest, keys
from schemas.store import read_result
from tests.conftest import chat, run_worker
from tests.test_lifecycle import succeeded
from worker.engine.generator import ChatGenerator
from worker.engine.models import ModelCache, weight_bytes
from worker.lifecycle.held import Lifecycle
from worker.runner.runtime import WorkerRuntime
from worker.schedule.step import model_waits


def _mixed(conn, n: int = 8, batch: str = "mixed", **kw) -> list[str]:
    """``n`` jobs alternating models ``a`` and ``b`` (a first): their ids."""
    jobs = {f"{'ab'[i % 2]}{i}": chat("ab"[i % 2], f"job {i}") for i in range(n)}
    return Client(connection=conn).submit(jobs, batch_id=batch, **kw).job_ids


def _takes(life: Lifecycle, wait_s: float, warm=("a",)) -> list[str]:
    """Every job the worker's queues hold, taken one by one by a worker holding ``warm``
    with ``--model-wait wait_s``: the custom ids in the order taken."""
    order, waits = [], model_waits(life.queues, wait_s)
    while (job := life.take(warm=warm, waits=waits)) is not None:
        order.append(job.envelope.custom_id)
        life.end(job, succeeded(job))
    return order


def test_a_worker_takes_its_models_jobs_first_then_the_others_in_order(conn):
    _mixed(conn)
    life = Lifecycle(conn, "w", ["mlxq"])
    assert _takes(life, 60) == ["a0", "a2", "a4", "a6", "b1", "b3", "b5", "b7"]


@pytest.mark.parametrize("how", ["bound 0", "nothing loaded", "head too old", "no model"])
def test_the_queue_is_taken_in_order(conn, how):
    ids = _mixed(conn)
    wait = 0 if how == "bound 0" else 60
    if how == "head too old":  # b1 has waited 2 minutes: past the bound, taken in turn
        conn.hset(keys.rq_job_key(ids[1]), "enqueued_at", "2026-01-01T00:00:00.000000Z")
    if how == "no model":  # a hash from before model-affine takes
        conn.hdel(keys.rq_job_key(ids[1]), "model")
    life = Lifecycle(conn, "w", ["mlxq"])
    warm = () if how == "nothing loaded" else ("a",)
    order = _takes(life, wait, warm)
    if how in ("head too old", "no model"):  # a0, then b1 (it may not be passed over)
        assert order[:2] == ["a0", "b1"] and order[2:] == ["a2", "a4", "a6", "b3", "b5", "b7"]
    else:
        assert order == [f"{'ab'[i % 2]}{i}" for i in range(8)]


def test_the_interactive_queue_is_taken_in_order(conn):
    Client(connection=conn, queue=keys.INTERACTIVE_QUEUE).submit(
        {f"{'ab'[i % 2]}{i}": chat("ab"[i % 2]) for i in range(4)}
    )
    life = Lifecycle(conn, "w", [keys.INTERACTIVE_QUEUE])
    assert _takes(life, 60) == ["a0", "b1", "a2", "b3"]


def test_tenants_still_take_turns(conn):
    _mixed(conn, 4, "t1", tenant="one")
    _mixed(conn, 4, "t2", tenant="two")
    life = Lifecycle(conn, "w", ["mlxq"])
    order = _takes(life, 60)
    # turns alternate between the tenants; within each, its a jobs first
    assert order == ["a0", "a0", "a2", "a2", "b1", "b1", "b3", "b3"]


def test_an_age_in_rq_time_is_read_as_redis_time(conn):
    """The bound counts a job's age from its ``enqueued_at`` (RQ's format) against Redis's
    clock: a job enqueued just now is young, one 31 s ago is past a 30 s bound."""
    from datetime import UTC, datetime

    ids = _mixed(conn, 6)
    life = Lifecycle(conn, "w", ["mlxq"])
    old = datetime.fromtimestamp(time.time() - 31, UTC)
    conn.hset(keys.rq_job_key(ids[1]), "enqueued_at", keys.rq_time(old))
    assert _takes(life, 30) == ["a0", "b1", "a2", "a4", "b3", "b5"]  # b3 is young: passed over


# -- end to end ---------------------------------------------------------------------
def _alternating(tiny, n: int) -> dict[str, dict]:
    models = (tiny.target, tiny.twin)  # the same size; two names, two loads
    return {
        f"j{i}": chat(models[i % 2], f"question {i}", max_tokens=6, temperature=0) for i in range(n)
    }


@pytest.mark.parametrize("max_batch", [1, 4])
def test_a_mixed_queue_with_room_for_one_model_loads_each_at_most_twice(
    conn, redis_url, tiny, max_batch
):
    jobs = _alternating(tiny, 12)
    s = Client(connection=conn).submit(jobs, batch_id=f"mixed{max_batch}")
    room = int(weight_bytes(Path(tiny.target)) * 1.6)  # one model and its jobs' KV caches
    rt = WorkerRuntime(cache=ModelCache(budget_bytes=room, prefix_bytes=0))
    run_worker(redis_url, runtime=rt, max_batch=max_batch)
    assert rt.cache.loads <= 4, rt.cache.loads  # each model at most twice
    for job_id, (name, body) in zip(s.job_ids, jobs.items(), strict=True):
        record = read_result(conn, job_id)
        assert record.status == "succeeded", (name, record.error)
        alone = ChatGenerator.get_or_create(body["model"], cache=ModelCache()).generate(
            ChatRequest.model_validate(body)
        )
        assert record.response.choices[0].message.content == alone.text, name


def test_in_order_the_same_queue_loads_a_model_for_every_job(conn, redis_url, tiny):
    """The same with ``--model-wait 0`` (the order before): the test above can fail."""
    from worker.runner.loop import Worker

    jobs = _alternating(tiny, 6)
    Client(connection=conn).submit(jobs, batch_id="in-order")
    room = int(weight_bytes(Path(tiny.target)) * 1.6)
    rt = WorkerRuntime(cache=ModelCache(budget_bytes=room, prefix_bytes=0))
    Worker(conn, ["mlxq"], rt, name="w0", max_batch=1, burst=True, model_wait_s=0).work()
    assert rt.cache.loads == 6
