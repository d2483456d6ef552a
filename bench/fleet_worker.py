"""A real mlxq worker process whose generation is replaced by a fixed sleep (fleet benchmark).

Everything else is the production path: the lifecycle's take (and start) script,
the lease and heartbeat, payload validation, the end script with its write-once
result record, batch counters and done list. Only the running of a job alone
(``worker.runner.loop.run_alone``: model, prompt, generation) is swapped for a sleep
standing in for a Mac's compute.
"""

from __future__ import annotations

import sys
import time

from schemas import AssistantMessage, ChatCompletion, Choice, Metrics, ResultRecord, Usage
from worker.runner import loop


def sleep_job(seconds: float):
    """``run_alone`` with its generation replaced by a sleep: the record is written by the
    real lifecycle, as any job's."""

    def run(job, route, rt, conn, upcoming=None):
        start = time.monotonic()
        time.sleep(seconds)
        req = job.envelope.request
        response = ChatCompletion(
            id=f"chatcmpl-{job.id[-20:]}",
            created=int(time.time()),
            model=req.model,
            choices=[Choice(message=AssistantMessage(content="simulated"), finish_reason="length")],
            usage=Usage(prompt_tokens=1, completion_tokens=1, total_tokens=2),
        )
        record = ResultRecord(
            job_id=job.id,
            batch_id=job.envelope.batch_id,
            custom_id=job.envelope.custom_id,
            status="succeeded",
            response=response,
            metrics=Metrics(worker_id=rt.worker_id, total_time_s=time.monotonic() - start),
            finished_at=time.time(),
        )
        return record, None

    return run


def rq_sleep_job(seconds: float, done_key: str) -> int:
    """The anchor: a plain RQ job doing the same sleep and announcing itself on a list."""
    from rq import get_current_job

    time.sleep(seconds)
    job = get_current_job()
    assert job is not None
    job.connection.rpush(done_key, job.id)
    return 1


def rq_main(url: str, name: str) -> None:
    """A plain RQ SimpleWorker (no fork, JSON): RQ's own per-job cost, for comparison."""
    from redis import Redis
    from rq import Queue, SimpleWorker
    from rq.serializers import JSONSerializer

    conn = Redis.from_url(url)
    queue = Queue("rq-anchor", connection=conn, serializer=JSONSerializer)
    worker = SimpleWorker([queue], connection=conn, serializer=JSONSerializer, name=name)
    worker.work(logging_level="WARNING", with_scheduler=False)


def main() -> None:
    if sys.argv[1] == "--rq":
        rq_main(sys.argv[2], sys.argv[3])
        return
    seconds = float(sys.argv[1])
    loop.run_alone = sleep_job(seconds)  # type: ignore[assignment]
    from worker.cli import main as worker_main

    worker_main(sys.argv[2:])


if __name__ == "__main__":
    main()
