"""What a worker publishes about itself (``mlxq:worker:<name>``), for ``producer fleet``."""

from __future__ import annotations

from pydantic import BaseModel, Field


class LoadedModelInfo(BaseModel):
    name: str
    adapter: str | None = None
    memory_mb: float
    pinned: bool = False


class PairStats(BaseModel):
    """Running totals for one (target, draft) pair on one worker."""

    target: str
    draft: str | None = None
    jobs: int = 0
    tokens: int = 0
    seconds: float = 0.0  # wall time with at least one of its jobs running (not their sum)
    accepted: int = 0
    proposed: int = 0

    @property
    def tokens_per_s(self) -> float | None:
        """Throughput: tokens over the wall time the pair was busy."""
        return self.tokens / self.seconds if self.seconds else None

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted / self.proposed if self.proposed else None


class PrefixCacheInfo(BaseModel):
    """A worker's prefix cache: kept prompt prefixes, their bytes, how often they served."""

    budget_mb: float
    used_mb: float = 0.0
    entries: int = 0
    lookups: int = 0
    hits: int = 0
    tokens_reused: int = 0

    @property
    def hit_rate(self) -> float | None:
        return self.hits / self.lookups if self.lookups else None


class BatchInfo(BaseModel):
    """A worker's running continuous batch: its size, what limits it, and its KV memory."""

    model: str
    size: int
    limit: int
    reason: str  # what sets the limit now: memory, measured speed, --max-batch, the queue
    kv_mb: float = 0.0  # KV cache the batch holds now
    kv_projected_mb: float = 0.0  # the most it can grow to with the jobs it holds
    kv_room_mb: float = 0.0  # what the memory budget leaves for KV caches


#: Upper bounds (seconds) of the latency histograms a worker publishes: OpenTelemetry
#: GenAI's advisory buckets for time to first token (10 ms to 10 s), then on to a day
#: for batch jobs that queue for hours.
LATENCY_BUCKETS: tuple[float, ...] = (
    0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    30.0, 60.0, 300.0, 900.0, 3600.0, 4 * 3600.0, 24 * 3600.0,
)  # fmt: skip
#: The latency histograms a worker publishes: what each measures.
LATENCIES = {
    "queue_wait": "submitted to taken by a worker",
    "time_to_first_token": "taken to the first completion token (prefill, model load)",
    "job": "taken to the record written",
}
#: The latencies a worker also publishes per queue (interactive vs batch queues).
QUEUE_LATENCIES = ("queue_wait", "time_to_first_token")


class Histogram(BaseModel):
    """Observations counted per bucket of :data:`LATENCY_BUCKETS` (the last one +Inf)."""

    counts: list[int] = Field(default_factory=lambda: [0] * (len(LATENCY_BUCKETS) + 1))
    sum: float = 0.0

    def observe(self, value: float) -> None:
        i = next((i for i, b in enumerate(LATENCY_BUCKETS) if value <= b), len(LATENCY_BUCKETS))
        self.counts[i] += 1
        self.sum += value

    @property
    def count(self) -> int:
        return sum(self.counts)

    def cumulative(self) -> list[tuple[str, int]]:
        """(upper bound, observations at or below it) as Prometheus exposes them."""
        out, total = [], 0
        for bound, n in zip([*map(str, LATENCY_BUCKETS), "+Inf"], self.counts, strict=True):
            total += n
            out.append((bound, total))
        return out


class WorkerInfo(BaseModel):
    name: str
    host: str
    pid: int
    queues: list[str]
    state: str
    current_job: str | None = None
    models: list[LoadedModelInfo] = []
    cache_budget_gb: float | None = None
    cache_used_gb: float = 0.0
    jobs_done: int = 0
    pairs: list[PairStats] = []
    speculation: dict[str, dict[str, float]] = {}
    prefix_cache: PrefixCacheInfo | None = None
    batch: BatchInfo | None = None
    max_batch: str = "auto"
    peak_batch: int = 0  # the most jobs one batch held since the worker started
    peak_kv_mb: float = 0.0  # the most KV cache one batch held
    # What jobs may name here: model directories, --model names, --allow-model globs.
    serves: list[str] = []
    # Totals since the worker started (Prometheus counters: a restart resets them).
    jobs_succeeded: int = 0
    jobs_failed: int = 0
    latency: dict[str, Histogram] = {}
    lease_s: float | None = None  # the worker's --lease-seconds
    replica_shortfalls: int = 0  # record writes fewer than --wait-replicas acknowledged
    # The machine kind whose shared figures the worker uses (None: it does not share), and
    # the measurements it took from the fleet's figures instead of measuring them.
    machine_kind: str | None = None
    figures_adopted: int = 0
    # Per queue: ``QUEUE_LATENCIES`` histograms; batch jobs preempted by interactive ones.
    queue_latency: dict[str, dict[str, Histogram]] = {}
    preemptions: int = 0
    # Audio jobs: seconds of audio transcribed, and wall seconds spent transcribing.
    audio_seconds: float = 0.0
    audio_busy_s: float = 0.0
    # Ranks of its worker group (``worker --shard``; 1: one machine), and its KV bits.
    group_size: int = 1
    shard: str | None = None
    kv_bits: int | None = None
    updated_at: float
