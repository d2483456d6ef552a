"""Tenants: their weights in fair share, and what each has queued.

A batch belongs to a tenant (``producer submit --tenant``); its jobs wait on the list
``<queue>@<tenant>`` and workers serving ``<queue>`` share their takes between the
tenants with work by weight (``schemas/lua/fair.lua``). Weights live in ``mlxq:tenants``.
"""

from __future__ import annotations

import math

from redis import Redis

from schemas import keys

MIN_WEIGHT, MAX_WEIGHT = 0.01, 100.0


def set_weight(conn: Redis, tenant: str, weight: float) -> None:
    """Give ``tenant`` ``weight`` (its share is weight / the sum of those with work)."""
    keys.validate_tenant(tenant)
    if not (math.isfinite(weight) and MIN_WEIGHT <= weight <= MAX_WEIGHT):
        raise ValueError(f"weight {weight!r} out of range: use {MIN_WEIGHT} to {MAX_WEIGHT}")
    conn.hset(keys.TENANTS, tenant, repr(float(weight)))


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
    """Per tenant, per queue: the jobs waiting (the lists RQ's queue set names)."""
    names = sorted(
        k.decode().removeprefix(keys.rq_queue_key("")) for k in conn.smembers(keys.RQ_QUEUES)
    )
    with conn.pipeline(transaction=False) as pipe:
        for name in names:
            pipe.llen(keys.rq_queue_key(name))
        depths = pipe.execute()
    out: dict[str, dict[str, int]] = {}
    for name, depth in zip(names, depths, strict=True):
        if depth:
            out.setdefault(keys.tenant_of(name), {})[keys.base_queue(name)] = int(depth)
    return out
