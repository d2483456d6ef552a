"""A finished job's bookkeeping is sent off the job path: it must still land, in full,
and never touch the state of the job that runs next."""

import signal

from rq.job import Job
from rq.registry import StartedJobRegistry
from rq.serializers import JSONSerializer
from rq.utils import now

from producer import Client
from schemas import keys
from schemas.store import read_result
from tests.conftest import chat
from tests.test_faults import wait_for


def test_bookkeeping_of_the_last_jobs_lands_when_the_worker_idles(conn, redis_url, tiny, workers):
    w = workers("--max-batch", "1", name="books")
    s = Client(connection=conn).submit([chat(tiny.target, max_tokens=2)] * 3)
    assert Client(connection=conn).wait(s.batch_id, timeout=60).done == 3
    wait_for(lambda: conn.hget("rq:worker:books", "state") == b"idle")
    worker = {k.decode(): v.decode() for k, v in conn.hgetall("rq:worker:books").items()}
    assert "current_job" not in worker
    assert worker["successful_job_count"] == "3"
    for job_id in s.job_ids:
        job = Job.fetch(job_id, connection=conn, serializer=JSONSerializer)
        assert job.get_status() == "finished"
        assert job.latest_result().return_value == {"status": "succeeded"}
        assert read_result(conn, job_id).status == "succeeded"
    assert StartedJobRegistry("mlxq", connection=conn).get_job_ids() == []
    assert conn.llen(keys.batch_done_key(s.batch_id)) == 3
    w.signal(signal.SIGTERM)
    assert w.wait(30) == 0


def test_bookkeeping_leaves_the_next_jobs_worker_state_alone(conn, tiny):
    from rq import Queue

    from worker import runtime as rt_mod
    from worker.bookkeeping import Finished
    from worker.rqworker import MlxqWorker, SafeJob

    rt_mod.install(rt_mod.WorkerRuntime(worker_id="order"))
    queue = Queue("mlxq", connection=conn, serializer=JSONSerializer)
    worker = MlxqWorker([queue], connection=conn, name="order")
    worker.register_birth()
    s = Client(connection=conn).submit([chat(tiny.target, max_tokens=2)] * 2)
    first, second = (SafeJob.fetch(j, connection=conn) for j in s.job_ids)
    worker.prepare_execution(first)
    finished = Finished(first, worker.execution)
    first.ended_at, first._result = now(), {"status": "succeeded"}
    worker.prepare_execution(second)  # the next job starts before the bookkeeping lands
    worker._books.send([finished])
    assert conn.hget(worker.key, "current_job") == second.id.encode()
    assert conn.hget(worker.key, "state") == b"busy"
    assert first.get_status(refresh=True) == "finished"
    assert not conn.exists(finished.execution.key)
    started = StartedJobRegistry("mlxq", connection=conn).get_job_ids()
    assert started == [second.id]
    worker.register_death()
