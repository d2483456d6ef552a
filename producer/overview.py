"""The fleet at a glance: recent batches, live workers and queue depths, read in five
pipelined round trips whose commands are bounded by how many batches, workers and queues
are shown, never by how many jobs wait (what the gateway's ``/ui`` page polls)."""

from __future__ import annotations

import time
from typing import Any

from pydantic import ValidationError
from redis import Redis

from producer.batches import status_of
from schemas import ResultRecord, keys, lanes
from schemas.fleet import WorkerInfo

#: The newest batches shown, the first errors shown per batch, and the queues shown.
BATCHES_SHOWN = 20
ERRORS_SHOWN = 5
QUEUES_SHOWN = 50
WORKERS_SHOWN = 200


def overview(
    conn: Redis, batches: int = BATCHES_SHOWN, tenant: str | None = None
) -> dict[str, Any]:
    """A JSON-ready snapshot: ``batches`` (newest first), ``workers`` and ``queues``; with a
    ``tenant``, only its batches and its queues' lists (the workers are the whole fleet's)."""
    batches = max(1, min(batches, 100))
    index = keys.BATCHES if tenant is None else keys.tenant_batches_key(tenant)
    with conn.pipeline(transaction=False) as pipe:
        pipe.zrevrange(index, 0, batches - 1)
        pipe.hkeys(keys.RUNNING)
        pipe.zrevrange(keys.WORKERS, 0, WORKERS_SHOWN - 1)
        pipe.srandmember(keys.RQ_QUEUES, QUEUES_SHOWN)
        ids_raw, running_raw, names_raw, queues_raw = pipe.execute()
    ids = [b.decode() for b in ids_raw]
    names = [n.decode() for n in names_raw]
    prefix = keys.rq_queue_key("")
    queue_names = sorted(q.decode().removeprefix(prefix) for q in queues_raw)
    if tenant is not None:
        queue_names = [q for q in queue_names if keys.tenant_of(q) == tenant]
    with conn.pipeline(transaction=False) as pipe:
        for batch_id in ids:
            pipe.hgetall(keys.batch_key(batch_id))
            pipe.lindex(keys.batch_done_key(batch_id), 0)
            pipe.lrange(keys.batch_errors_key(batch_id), 0, keys.BATCH_ERRORS_KEPT - 1)
        if names:
            pipe.mget([keys.worker_key(n) for n in names])
        replies = pipe.execute()
    per_batch = [replies[3 * i : 3 * i + 3] for i in range(len(ids))]
    rest = replies[3 * len(ids) :]
    worker_raws = rest.pop(0) if names else []
    depths = lanes.depths(conn, queue_names)  # (a lane's batches' own lists too)
    firsts = [done.decode() if done else None for _, done, _ in per_batch]
    errors = [list(dict.fromkeys(e.decode() for e in errs)) for _, _, errs in per_batch]
    wanted = [j for j in firsts if j] + [j for errs in errors for j in errs]
    records: dict[str, bytes | None] = (
        dict(zip(wanted, conn.mget([keys.result_key(j) for j in wanted]), strict=True))
        if wanted
        else {}
    )
    running: dict[str, int] = {}
    for job_id in running_raw:
        batch = keys.batch_of(job_id.decode())
        running[batch] = running.get(batch, 0) + 1
    now = time.time()
    out_batches, gone = [], []
    for batch_id, (meta_raw, _, _), first, errs in zip(ids, per_batch, firsts, errors, strict=True):
        if not meta_raw:
            gone.append(batch_id)
            continue
        meta = {k.decode(): v.decode() for k, v in meta_raw.items()}
        if tenant is not None and meta.get("tenant", keys.DEFAULT_TENANT) != tenant:
            continue
        out_batches.append(
            _batch(batch_id, meta, running.get(batch_id, 0), records, first, errs, now)
        )
    for key, members in keys.gone_batches(gone, tenant):
        conn.zrem(key, *members)
    return {
        "at": now,
        "tenant": tenant,
        "batches": out_batches,
        "workers": [_worker(r) for r in worker_raws if r is not None],
        "queues": [{"name": q, "depth": d} for q, d in zip(queue_names, depths, strict=True)],
    }


def _record(raw: bytes | None) -> ResultRecord | None:
    try:
        return ResultRecord.model_validate_json(raw) if raw else None
    except ValidationError:
        return None


def _batch(
    batch_id: str,
    meta: dict[str, str],
    running: int,
    records: dict[str, bytes | None],
    first: str | None,
    errors: list[str],
    now: float,
) -> dict[str, Any]:
    began = None
    if first and (record := _record(records.get(first))) is not None:
        run_s = record.metrics.total_time_s if record.metrics is not None else None
        began = record.finished_at - (run_s or 0.0)
    s = status_of(batch_id, meta, running, began=began, now=now)
    shown = []
    for job_id in errors:
        record = _record(records.get(job_id))
        if record is None or record.status != "failed" or len(shown) >= ERRORS_SHOWN:
            continue
        shown.append(
            {
                "custom_id": record.custom_id,
                "status_code": record.status_code,
                "code": record.error.code if record.error else "",
                "message": (record.error.message if record.error else "")[:300],
            }
        )
    if meta.get("gw_status") in ("validating", "failed"):
        state = meta["gw_status"]
    elif s.cancelled_at is not None:
        state = "cancelling" if s.running else "cancelled"
    else:
        state = "completed" if s.finished else "in_progress"
    return s.as_dict() | {
        "state": state,
        "created_at": s.created_at,
        "endpoint": meta.get("endpoint") or "/v1/chat/completions",
        "retried": int(meta.get("retried", 0)),
        "errors": shown,
    }


def _worker(raw: bytes) -> dict[str, Any]:
    try:
        w = WorkerInfo.model_validate_json(raw)
    except ValidationError:
        return {"name": "?", "state": "unreadable entry"}
    tokens = sum(p.tokens for p in w.pairs)
    seconds = sum(p.seconds for p in w.pairs)
    accepted = sum(p.accepted for p in w.pairs)
    proposed = sum(p.proposed for p in w.pairs)
    return {
        "name": w.name,
        "host": w.host,
        "state": w.state,
        "queues": w.queues,
        "models": [m.name for m in w.models],
        "batch": w.batch.size if w.batch else 0,
        "batch_limit": w.batch.limit if w.batch else None,
        "jobs_done": w.jobs_done,
        "jobs_failed": w.jobs_failed,
        "tokens_per_s": tokens / seconds if seconds > 0 else None,
        "acceptance": accepted / proposed if proposed else None,
        "memory_gb": w.cache_used_gb,
        "memory_budget_gb": w.cache_budget_gb,
        "updated_at": w.updated_at,
    }
