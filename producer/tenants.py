"""Tenants: their weights in fair share, and what each has queued.

A batch belongs to a tenant (``producer submit --tenant``); its jobs wait on the list
``<queue>@<tenant>`` and workers serving ``<queue>`` share their takes between the
tenants with work by weight (``schemas/lua/fair.lua``). Weights live in ``mlxq:tenants``.
"""

from __future__ import annotations

import math
import time

from redis import Redis

from schemas import keys, lanes

MIN_WEIGHT, MAX_WEIGHT = 0.01, 100.0


def check_weight(weight: float) -> float:
    """``weight`` if it is a fair-share weight (ValueError naming the range if not)."""
    if not (math.isfinite(weight) and MIN_WEIGHT <= weight <= MAX_WEIGHT):
        raise ValueError(f"weight {weight!r} out of range: use {MIN_WEIGHT} to {MAX_WEIGHT}")
    return float(weight)


def set_weight(conn: Redis, tenant: str, weight: float) -> None:
    """Give ``tenant`` ``weight`` (its share is weight / the sum of those with work)."""
    keys.validate_tenant(tenant)
    conn.hset(keys.TENANTS, tenant, repr(check_weight(weight)))


def set_limits(
    conn: Redis, tenant: str, max_running: int | None, tokens_per_day: int | None
) -> None:
    """Set (a number) or clear (0) the tenant's running limit and daily token quota."""
    keys.validate_tenant(tenant)
    if tenant == keys.DEFAULT_TENANT and max_running:
        raise ValueError("the default tenant takes no running limit (name the tenant's batches)")
    for key, value in ((keys.TENANT_LIMITS, max_running), (keys.TENANT_QUOTAS, tokens_per_day)):
        if value is None:
            continue
        if value < 0:
            raise ValueError(f"limits are 0 (none) or more, not {value}")
        if value:
            conn.hset(key, tenant, value)
        else:
            conn.hdel(key, tenant)


def limits(conn: Redis) -> dict[str, dict[str, int]]:
    """Per tenant with one: ``max_running`` and ``tokens_per_day``."""
    out: dict[str, dict[str, int]] = {}
    for key, name in ((keys.TENANT_LIMITS, "max_running"), (keys.TENANT_QUOTAS, "tokens_per_day")):
        for k, v in conn.hgetall(key).items():
            if v.isdigit():
                out.setdefault(k.decode(), {})[name] = int(v)
    return out


def weights(conn: Redis) -> dict[str, float]:
    """Every tenant given a weight (others weigh 1)."""
    out = {}
    for k, v in conn.hgetall(keys.TENANTS).items():
        try:
            out[k.decode()] = float(v)
        except ValueError:
            continue
    return out


def queued(conn: Redis) -> dict[str, dict[str, int]]:
    """Per tenant, per queue: the jobs waiting (the lists RQ's queue set names, and
    their batches' own lists)."""
    names = sorted(
        k.decode().removeprefix(keys.rq_queue_key("")) for k in conn.smembers(keys.RQ_QUEUES)
    )
    depths = lanes.depths(conn, names)
    out: dict[str, dict[str, int]] = {}
    for name, depth in zip(names, depths, strict=True):
        if depth:
            per = out.setdefault(keys.tenant_of(name), {})
            base = keys.base_queue(name)  # (a tenant's lists of every priority, summed)
            per[base] = per.get(base, 0) + int(depth)
    return out


#: The fields the end script counts per tenant and day (``schemas.keys.usage_key``).
USAGE_FIELDS = ("jobs", "failed", "prompt_tokens", "completion_tokens", "job_seconds")
#: Tenants a usage report or a metrics scrape names at most (the busiest by jobs).
USAGE_TENANTS = 100


def parse_usage(raw: dict[bytes, bytes]) -> dict[str, dict[str, float]]:
    """One day's usage hash as tenant -> field -> total (unknown fields skipped)."""
    out: dict[str, dict[str, float]] = {}
    for k, v in raw.items():
        tenant, _, name = k.decode().rpartition(":")
        if name in USAGE_FIELDS and tenant:
            try:
                out.setdefault(tenant, dict.fromkeys(USAGE_FIELDS, 0.0))[name] = float(v)
            except ValueError:
                continue
    return out


def usage(
    conn: Redis, days: int = 1, tenant: str | None = None, now: float | None = None
) -> dict[str, dict[str, float]]:
    """Per tenant, the totals of the last ``days`` UTC days (today included), the busiest
    :data:`USAGE_TENANTS` by jobs."""
    at = time.time() if now is None else now
    with conn.pipeline(transaction=False) as pipe:
        for d in range(days):
            pipe.hgetall(keys.usage_key(keys.usage_day(at - d * 86400)))
        raws = pipe.execute()
    out: dict[str, dict[str, float]] = {}
    for raw in raws:
        for name, fields in parse_usage(raw).items():
            if tenant is not None and name != tenant:
                continue
            total = out.setdefault(name, dict.fromkeys(USAGE_FIELDS, 0.0))
            for f, v in fields.items():
                total[f] += v
    busiest = sorted(out, key=lambda n: -out[n]["jobs"])[:USAGE_TENANTS]
    return {n: out[n] for n in sorted(busiest)}
