"""Per-worker running totals, published in the fleet registry."""

from __future__ import annotations

from dataclasses import dataclass, field

from schemas import ResultRecord
from schemas.fleet import LATENCIES, Histogram, PairStats
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

    def ended(self, record: ResultRecord) -> None:
        """Count a record this worker wrote, and observe its latencies."""
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

    def add_batch(self, size: int, kv_bytes: int, projected_bytes: int) -> None:
        self.peak_batch = max(self.peak_batch, size)
        self.peak_kv_bytes = max(self.peak_kv_bytes, kv_bytes)
        self.peak_projected_kv_bytes = max(self.peak_projected_kv_bytes, projected_bytes)

    def add(self, target: str, draft: str | None, out: GenerationOutput) -> None:
        self.jobs_done += 1
        pair = self.pairs.setdefault((target, draft), PairStats(target=target, draft=draft))
        pair.jobs += 1
        pair.tokens += out.completion_tokens
        pair.seconds += out.total_time_s
        pair.accepted += out.draft_tokens_accepted
        pair.proposed += out.draft_tokens_proposed
