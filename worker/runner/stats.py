"""Per-worker running totals, published in the fleet registry."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from schemas import ResultRecord, keys
from schemas.fleet import LATENCIES, QUEUE_LATENCIES, Histogram, PairStats
from worker.engine import GenerationOutput


@dataclass
class WorkerStats:
    """Jobs done, and tokens/s and acceptance per (target, draft) pair."""

    jobs_done: int = 0
    pairs: dict[tuple[str, str | None], PairStats] = field(default_factory=dict)
    # Continuous batches: the most jobs one held, and the most KV cache one held
    # (measured) and was projected to hold at most (what admission checked).
    peak_batch: int = 0
    peak_kv_bytes: int = 0
    peak_projected_kv_bytes: int = 0
    # Records written (``ended``), and their latencies (``schemas.fleet.LATENCIES``).
    succeeded: int = 0
    failed: int = 0
    latency: dict[str, Histogram] = field(
        default_factory=lambda: {name: Histogram() for name in LATENCIES}
    )
    # Per queue: queue wait and time to first token (interactive vs batch queues).
    by_queue: dict[str, dict[str, Histogram]] = field(default_factory=dict)
    # Batch jobs handed back to their queue to make room for interactive ones.
    preemptions: int = 0
    # Per pair, when its last counted job ended (monotonic): the wall time it was busy is
    # the union of its jobs' spans, not their sum (a batch of 20 jobs of 20 s is 20 s).
    busy_until: dict[tuple[str, str | None], float] = field(default_factory=dict)
    # Audio jobs: seconds of audio transcribed, and the wall seconds spent on them.
    audio_seconds: float = 0.0
    audio_busy_s: float = 0.0

    def ended(self, record: ResultRecord, queue: str | None = None) -> None:
        """Count a record this worker wrote, and observe its latencies (also per ``queue``)."""
        if record.status == "succeeded":
            self.succeeded += 1
        else:
            self.failed += 1
        m = record.metrics
        if m is None:
            return
        for name, value in (
            ("queue_wait", m.queue_wait_s),
            ("time_to_first_token", m.time_to_first_token_s),
            ("job", m.total_time_s),
        ):
            if value is not None:
                self.latency[name].observe(value)
                if queue is not None and name in QUEUE_LATENCIES:
                    base = keys.base_queue(queue)  # (a tenant's list: its queue's label)
                    per = self.by_queue.setdefault(base, {n: Histogram() for n in QUEUE_LATENCIES})
                    per[name].observe(value)

    def add_audio(self, audio_s: float, wall_s: float) -> None:
        self.audio_seconds += audio_s
        self.audio_busy_s += wall_s

    def add_batch(self, size: int, kv_bytes: int, projected_bytes: int) -> None:
        self.peak_batch = max(self.peak_batch, size)
        self.peak_kv_bytes = max(self.peak_kv_bytes, kv_bytes)
        self.peak_projected_kv_bytes = max(self.peak_projected_kv_bytes, projected_bytes)

    def add(
        self, target: str, draft: str | None, out: GenerationOutput, now: float | None = None
    ) -> None:
        """Count a job that ended ``now`` (monotonic) after ``out.total_time_s``."""
        self.jobs_done += 1
        key = (target, draft)
        pair = self.pairs.setdefault(key, PairStats(target=target, draft=draft))
        pair.jobs += 1
        pair.tokens += out.completion_tokens
        end = time.monotonic() if now is None else now
        start = max(end - out.total_time_s, self.busy_until.get(key, 0.0))
        pair.seconds += max(0.0, end - start)
        self.busy_until[key] = max(end, self.busy_until.get(key, 0.0))
        pair.accepted += out.draft_tokens_accepted
        pair.proposed += out.draft_tokens_proposed
