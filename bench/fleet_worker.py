"""A real mlxq worker process whose generation is replaced by a fixed sleep (fleet benchmark).

Everything else is the production path: RQ dequeue through the intermediate
list, leases and heartbeats, payload validation, the write-once result record,
the batch counters and done list. Only ``ChatGenerator.get_or_create`` and the
generation are swapped for a sleep standing in for a Mac's compute.
"""

from __future__ import annotations

import sys
import time

from worker import jobs
from worker.engine import GenerationOutput


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


def main() -> None:
    seconds = float(sys.argv[1])
    jobs.ChatGenerator.get_or_create = classmethod(  # type: ignore[method-assign]
        lambda cls, *a, **k: SleepGenerator(seconds)
    )
    from worker.cli import main as worker_main

    worker_main(sys.argv[2:])


if __name__ == "__main__":
    main()
