"""Prometheus metrics for the fleet, read from Redis at each scrape (no key scans).

Served by the gateway (``GET /metrics``) and by ``producer metrics --port`` alone.
Each scrape costs six pipelined round trips whatever the number of jobs: queue
lengths (a lane's batches' own lists too: ``schemas.lanes``) and RQ's registry sizes
per queue, the fleet registry (one ``MGET``), the lease table, and the
:data:`RECENT_BATCHES` newest batches' counters; then the shared figures' index and
its scopes (``producer.figures``). Names follow
rq-exporter where they mean the same thing (``rq_jobs``, ``rq_workers``) and
OpenTelemetry's GenAI conventions for latency (``gen_ai_server_*``); the rest are
``mlxq_*``. Per-worker counters and histograms are the worker's own totals since it
started, published in its registry entry: a restart resets them, as a process's
own ``/metrics`` would, and PromQL's ``rate()`` handles that.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Iterator
from typing import Any

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector, CollectorRegistry
from redis import Redis

from producer.batches import status_of
from producer.figures import Belief, beliefs
from producer.tenants import USAGE_TENANTS, parse_usage
from schemas import keys, lanes
from schemas.figures import measurements
from schemas.fleet import WorkerInfo

#: Batches whose progress a scrape reports (the newest first): a bound on the scrape's
#: cost and on the series Prometheus keeps.
RECENT_BATCHES = 20
#: Worker latency histograms -> (metric name, help).
HISTOGRAMS = {
    "queue_wait": ("mlxq_queue_wait_seconds", "Seconds from submit to a worker taking the job."),
    "time_to_first_token": (
        "gen_ai_server_time_to_first_token_seconds",
        "Seconds from a worker taking a job to its first completion token.",
    ),
    "job": (
        "gen_ai_server_request_duration_seconds",
        "Seconds from a worker taking a job to its record written.",
    ),
}

#: Worker latency histograms per queue (``schemas.fleet.QUEUE_LATENCIES``).
QUEUE_HISTOGRAMS = {
    "queue_wait": ("mlxq_queue_wait_by_queue_seconds", "Seconds from submit to taken, per queue."),
    "time_to_first_token": (
        "mlxq_time_to_first_token_by_queue_seconds",
        "Seconds from taken to the first completion token, per queue.",
    ),
}


def _text(raw: bytes | str | None) -> str:
    return raw.decode() if isinstance(raw, bytes) else (raw or "")


class FleetCollector(Collector):
    """Collects the fleet's state from Redis on every scrape."""

    def __init__(self, conn: Redis, recent_batches: int = RECENT_BATCHES) -> None:
        self.conn, self.recent_batches = conn, recent_batches

    def describe(self) -> Iterable[Metric]:
        return []  # collected live: no fixed description (and no scrape at registration)

    def read(self) -> dict[str, Any]:
        """Everything one scrape reports, in four pipelined round trips."""
        pipe = self.conn.pipeline(transaction=False)
        pipe.smembers(keys.RQ_QUEUES)
        pipe.zrange(keys.WORKERS, 0, -1)
        pipe.zrange(keys.LEASES, 0, -1, withscores=True)
        pipe.hgetall(keys.HOLDERS)
        pipe.hkeys(keys.RUNNING)
        pipe.zrevrange(keys.BATCHES, 0, self.recent_batches - 1)
        pipe.time()
        pipe.hgetall(keys.usage_key(keys.usage_day(time.time())))
        rq_queues, names, leases, holders, running, batches, now, today = pipe.execute()
        prefix = len(keys.rq_queue_key(""))
        queues = sorted(_text(q)[prefix:] for q in rq_queues)
        names = [_text(n) for n in names]
        batches = [_text(b) for b in batches]
        pipe = self.conn.pipeline(transaction=False)
        for q in queues:
            pipe.zcard(keys.rq_started_key(q))
            pipe.zcard(keys.rq_finished_key(q))
            pipe.zcard(keys.rq_failed_key(q))
        if names:
            pipe.mget([keys.worker_key(n) for n in names])
        for b in batches:
            pipe.hgetall(keys.batch_key(b))
        replies = pipe.execute()
        waiting = lanes.depths(self.conn, queues)  # (a lane's batches' own lists too)
        depth = {q: [waiting[i], *replies[3 * i : 3 * i + 3]] for i, q in enumerate(queues)}
        rest = replies[3 * len(queues) :]
        raws = rest.pop(0) if names else []
        workers = [WorkerInfo.model_validate_json(r) for r in raws if r is not None]
        now_ms = int(now[0]) * 1000 + int(now[1]) // 1000
        lease_left: dict[str, float] = {}
        for token, deadline in leases:
            holder = holders.get(token)
            if holder:
                lease_left[json.loads(holder)["name"]] = (deadline - now_ms) / 1000
        running_by_batch: dict[str, int] = {}
        for job_id in running:
            batch = _text(job_id).rsplit("-", 1)[0]
            running_by_batch[batch] = running_by_batch.get(batch, 0) + 1
        progress = {}
        for b, raw in zip(batches, rest, strict=True):
            if raw:  # (expired batches leave their id in mlxq:batches a while)
                meta = {_text(k): _text(v) for k, v in raw.items()}
                st = status_of(b, meta, running_by_batch.get(b, 0))
                progress[b] = {
                    "queued": st.queued,
                    "running": st.running,
                    "succeeded": st.succeeded,
                    "failed": st.failed,
                    "cancelled": st.cancelled,
                }
        return {
            "queues": depth,
            "workers": workers,
            "lease_left": lease_left,
            "running": len(running),
            "batches": progress,
            "usage": parse_usage(today),
        }

    def collect(self) -> Iterator[Metric]:
        state = self.read()
        yield from _queue_metrics(state["queues"], state["running"])
        yield from _batch_metrics(state["batches"])
        yield from _worker_metrics(state["workers"], state["lease_left"])
        yield from _figures_metrics(beliefs(self.conn, prune=False)[0])
        yield from _usage_metrics(state["usage"])


def _usage_metrics(today: dict[str, dict[str, float]]) -> Iterator[Metric]:
    """Today's (UTC) usage per tenant: the busiest :data:`USAGE_TENANTS` (bounded series)."""
    family = GaugeMetricFamily(
        "mlxq_tenant_usage_today",
        "Today's (UTC) usage per tenant: jobs, failed, prompt_tokens, completion_tokens, "
        "job_seconds (resets at midnight UTC).",
        labels=["tenant", "kind"],
    )
    busiest = sorted(today, key=lambda n: -today[n]["jobs"])[:USAGE_TENANTS]
    for tenant in sorted(busiest):
        for kind, value in today[tenant].items():
            family.add_metric([tenant, kind], value)
    yield family


def _figures_metrics(found: list[Belief]) -> Iterator[Metric]:
    """What the fleet's shared figures rest on, per target and machine kind."""
    measured = GaugeMetricFamily(
        "mlxq_figures_measurements",
        "Measurements behind the fleet's shared figures (one-job arms and batch sizes).",
        labels=["target", "machine_kind"],
    )
    for b in found:
        if b.figures is not None:
            measured.add_metric([b.label.target, b.label.kind], measurements(b.figures))
    yield measured


def _queue_metrics(queues: dict[str, list[int]], running: int) -> Iterator[Metric]:
    jobs = GaugeMetricFamily("rq_jobs", "Jobs per queue and RQ status.", labels=["queue", "status"])
    for q, (queued, started, finished, failed) in queues.items():
        for status, n in (
            ("queued", queued),
            ("started", started),
            ("finished", finished),
            ("failed", failed),
        ):
            jobs.add_metric([q, status], n)
    yield jobs
    yield GaugeMetricFamily(
        "mlxq_jobs_running", "Jobs some worker holds now (mlxq:running).", value=running
    )


def _batch_metrics(batches: dict[str, dict[str, int]]) -> Iterator[Metric]:
    family = GaugeMetricFamily(
        "mlxq_batch_jobs",
        f"Jobs per batch and status (the {RECENT_BATCHES} newest batches).",
        labels=["batch", "status"],
    )
    for b, counts in batches.items():
        for status, n in counts.items():
            family.add_metric([b, status], n)
    yield family


def _worker_metrics(workers: list[WorkerInfo], lease_left: dict[str, float]) -> Iterator[Metric]:
    def gauge(name: str, doc: str, *extra: str) -> GaugeMetricFamily:
        return GaugeMetricFamily(name, doc, labels=["worker", *extra])

    rq_workers = GaugeMetricFamily(
        "rq_workers", "Live workers (1 each).", labels=["name", "queues", "state"]
    )
    up = gauge("mlxq_worker_up", "1 while the worker's registry entry is live.")
    jobs = CounterMetricFamily(
        "mlxq_worker_jobs", "Records written since the worker started.", labels=["worker", "status"]
    )
    tokens = CounterMetricFamily(
        "mlxq_worker_generated_tokens", "Completion tokens since start.", labels=["worker"]
    )
    tps = gauge("mlxq_worker_tokens_per_second", "Tokens/s per pair.", "target", "draft")
    accept = gauge("mlxq_worker_acceptance_ratio", "Speculative acceptance.", "target", "draft")
    batch = gauge("mlxq_worker_batch_size", "Jobs in the running continuous batch.")
    limit = gauge("mlxq_worker_batch_limit", "The running batch's size limit.")
    kv = gauge("mlxq_worker_kv_cache_bytes", "KV cache bytes the running batch holds.")
    memory = gauge("mlxq_worker_model_cache_bytes", "Bytes of loaded models and prefixes.")
    group_size = gauge("mlxq_worker_group_size", "Ranks one model is split across (--shard).")
    hits = CounterMetricFamily(
        "mlxq_worker_prefix_cache_hits", "Jobs served a kept prefix.", labels=["worker"]
    )
    lookups = CounterMetricFamily(
        "mlxq_worker_prefix_cache_lookups", "Jobs that looked one up.", labels=["worker"]
    )
    reused = CounterMetricFamily(
        "mlxq_worker_prefix_cache_reused_tokens",
        "Prompt tokens taken from kept prefixes, not prefilled.",
        labels=["worker"],
    )
    entries = gauge("mlxq_worker_prefix_cache_entries", "Prefixes the worker keeps.")
    kept = gauge("mlxq_worker_prefix_cache_bytes", "Bytes of the prefixes the worker keeps.")
    shortfalls = CounterMetricFamily(
        "mlxq_worker_replica_shortfalls",
        "Record writes fewer replicas acknowledged than --wait-replicas asks.",
        labels=["worker"],
    )
    preempted = CounterMetricFamily(
        "mlxq_worker_preemptions",
        "Batch jobs handed back to their queue to make room for interactive ones.",
        labels=["worker"],
    )
    audio = CounterMetricFamily(
        "mlxq_worker_audio_seconds", "Seconds of audio transcribed.", labels=["worker"]
    )
    audio_busy = CounterMetricFamily(
        "mlxq_worker_audio_busy_seconds",
        "Wall seconds spent transcribing (audio seconds / these: its speed).",
        labels=["worker"],
    )
    per_queue = {
        k: HistogramMetricFamily(name, doc, labels=["worker", "queue"])
        for k, (name, doc) in QUEUE_HISTOGRAMS.items()
    }
    adopted = CounterMetricFamily(
        "mlxq_worker_figures_adopted",
        "Measurements the worker took from the fleet's shared figures instead of measuring.",
        labels=["worker"],
    )
    renew = gauge(
        "mlxq_worker_lease_renew_age_seconds",
        "Seconds since the worker last renewed its lease (lease length minus what is left).",
    )
    hists = {
        k: HistogramMetricFamily(name, doc, labels=["worker"])
        for k, (name, doc) in HISTOGRAMS.items()
    }
    for w in workers:
        rq_workers.add_metric([w.name, ",".join(w.queues), w.state], 1)
        up.add_metric([w.name], 1)
        jobs.add_metric([w.name, "succeeded"], w.jobs_succeeded)
        jobs.add_metric([w.name, "failed"], w.jobs_failed)
        tokens.add_metric([w.name], sum(p.tokens for p in w.pairs))
        for p in w.pairs:
            pair = [w.name, p.target, p.draft or ""]
            if p.tokens_per_s is not None:
                tps.add_metric(pair, p.tokens_per_s)
            if p.acceptance_rate is not None:
                accept.add_metric(pair, p.acceptance_rate)
        b = w.batch
        batch.add_metric([w.name], b.size if b else 0)
        if b is not None:
            limit.add_metric([w.name], b.limit)
        kv.add_metric([w.name], (b.kv_mb if b else 0.0) * 1e6)
        memory.add_metric([w.name], w.cache_used_gb * 1e9)
        group_size.add_metric([w.name], w.group_size)
        if (pc := w.prefix_cache) is not None:
            hits.add_metric([w.name], pc.hits)
            lookups.add_metric([w.name], pc.lookups)
            reused.add_metric([w.name], pc.tokens_reused)
            entries.add_metric([w.name], pc.entries)
            kept.add_metric([w.name], pc.used_mb * 1e6)
        shortfalls.add_metric([w.name], w.replica_shortfalls)
        adopted.add_metric([w.name], w.figures_adopted)
        preempted.add_metric([w.name], w.preemptions)
        audio.add_metric([w.name], w.audio_seconds)
        audio_busy.add_metric([w.name], w.audio_busy_s)
        for queue, hs in w.queue_latency.items():
            for k, family in per_queue.items():
                if (h := hs.get(k)) is not None:
                    family.add_metric([w.name, queue], h.cumulative(), h.sum)
        if w.lease_s is not None and w.name in lease_left:
            renew.add_metric([w.name], max(w.lease_s - lease_left[w.name], 0.0))
        for k, family in hists.items():
            h = w.latency.get(k)
            if h is not None:
                family.add_metric([w.name], h.cumulative(), h.sum)
    yield from (rq_workers, up, jobs, tokens, tps, accept, batch, limit, kv, memory, group_size)
    yield from (hits, lookups, reused, entries, kept, shortfalls, adopted, preempted, renew)
    yield from (audio, audio_busy)
    yield from (*hists.values(), *per_queue.values())


def registry_for(conn: Redis, recent_batches: int = RECENT_BATCHES) -> CollectorRegistry:
    """A registry holding only the fleet collector (what ``/metrics`` exposes)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(FleetCollector(conn, recent_batches))
    return registry
