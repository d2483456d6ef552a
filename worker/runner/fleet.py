"""What a worker publishes of itself (``producer fleet``): built from its runtime."""

from __future__ import annotations

import os
import socket
import time

from schemas.fleet import BatchInfo, LoadedModelInfo, PrefixCacheInfo, WorkerInfo
from worker.runner.figures import SharedFigures
from worker.runner.runtime import WorkerRuntime


def worker_info(
    rt: WorkerRuntime,
    name: str,
    queues: list[str],
    state: str,
    current_job: str | None,
    batch: BatchInfo | None = None,
    max_batch: int | None = None,
    lease_s: float | None = None,
    replica_shortfalls: int = 0,
    figures: SharedFigures | None = None,
) -> WorkerInfo:
    cache = rt.cache
    return WorkerInfo(
        name=name,
        host=socket.gethostname(),
        pid=os.getpid(),
        queues=queues,
        state=state,
        current_job=current_job,
        models=[
            LoadedModelInfo(
                name=e.name, adapter=e.adapter, memory_mb=round(e.nbytes / 1e6, 1), pinned=e.pinned
            )
            for e in cache.entries()
        ],
        cache_budget_gb=cache.budget_bytes / 1e9 if cache.budget_bytes else None,
        cache_used_gb=round(cache.used_bytes / 1e9, 3),
        jobs_done=rt.stats.jobs_done,
        pairs=list(rt.stats.pairs.values()),
        speculation=rt.policy.summary(),
        prefix_cache=_prefix_info(rt),
        batch=batch,
        max_batch=str(max_batch or "auto"),
        peak_batch=rt.stats.peak_batch,
        peak_kv_mb=round(rt.stats.peak_kv_bytes / 1e6, 1),
        serves=rt.access.describe() if rt.access else _open(rt),
        jobs_succeeded=rt.stats.succeeded,
        jobs_failed=rt.stats.failed,
        latency={k: h.model_copy(deep=True) for k, h in rt.stats.latency.items()},
        queue_latency={
            q: {k: h.model_copy(deep=True) for k, h in hs.items()}
            for q, hs in rt.stats.by_queue.items()
        },
        preemptions=rt.stats.preemptions,
        audio_seconds=round(rt.stats.audio_seconds, 3),
        audio_busy_s=round(rt.stats.audio_busy_s, 3),
        lease_s=lease_s,
        replica_shortfalls=replica_shortfalls,
        machine_kind=figures.kind if figures else None,
        figures_adopted=figures.adopted if figures else 0,
        group_size=cache.group.size if cache.group is not None else 1,
        shard=cache.group.mode if cache.group is not None else None,
        kv_bits=cache.kv_quant.bits if cache.kv_quant is not None else None,
        updated_at=time.time(),
    )


def _open(rt: WorkerRuntime) -> list[str]:
    """A runtime without model access rules (embedded): any local path."""
    return ["any local path", *(f"--allow-model {p}" for p in rt.allow_models)]


def _prefix_info(rt: WorkerRuntime) -> PrefixCacheInfo | None:
    store = rt.cache.prefixes
    if not store.enabled:
        return None
    stats = store.stats
    return PrefixCacheInfo(
        budget_mb=round(store.budget_bytes / 1e6, 1),
        used_mb=round(store.nbytes / 1e6, 1),
        entries=len(store),
        lookups=stats.lookups,
        hits=stats.hits,
        tokens_reused=stats.tokens_reused,
    )
