"""What a worker publishes about itself (``mlxq:worker:<name>``), for ``producer fleet``."""

from __future__ import annotations

from pydantic import BaseModel


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
    seconds: float = 0.0
    accepted: int = 0
    proposed: int = 0

    @property
    def tokens_per_s(self) -> float | None:
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
    updated_at: float
