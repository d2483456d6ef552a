"""A real mlxq worker process whose generation is replaced by a fixed sleep (fleet benchmark).

Everything else is the production path: the lifecycle's take (and start) script,
the lease and heartbeat, payload validation, the end script with its write-once
result record, batch counters and done list. Only ``ChatGenerator.get_or_create``
and the generation are swapped for a sleep standing in for a Mac's compute.
"""

from __future__ import annotations

import sys
import time

from worker.engine import GenerationOutput
from worker.runner import alone as jobs


class SleepGenerator:
    load_time_s = 0.0
    cache_hit = True

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def generate(self, request, default_num_draft_tokens=3, on_text=None, **_) -> GenerationOutput:
        time.sleep(self.seconds)
        return GenerationOutput(
            text="simulated",
            finish_reason="length",
            prompt_tokens=1,
            completion_tokens=1,
            time_to_first_token_s=self.seconds,
            prompt_tokens_per_s=0.0,
            generation_tokens_per_s=0.0,
            total_time_s=self.seconds,
            draft_tokens_proposed=0,
            draft_tokens_accepted=0,
            peak_memory_gb=0.0,
            token_ids=(0,),
        )


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
    jobs.ChatGenerator.get_or_create = classmethod(  # type: ignore[method-assign]
        lambda cls, *a, **k: SleepGenerator(seconds)
    )
    from worker.cli import main as worker_main

    worker_main(sys.argv[2:])


if __name__ == "__main__":
    main()
