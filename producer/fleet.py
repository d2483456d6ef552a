"""Reading the fleet registry that workers publish (``mlxq:workers``, ``mlxq:worker:<name>``)."""

from __future__ import annotations

from redis import Redis

from schemas import keys
from schemas.fleet import WorkerInfo


def live_workers(conn: Redis) -> list[WorkerInfo]:
    """Workers whose entry has not expired, by name; expired names are pruned."""
    names = [n.decode() for n in conn.zrange(keys.WORKERS, 0, -1)]
    if not names:
        return []
    raws = conn.mget([keys.worker_key(n) for n in names])
    dead = [n for n, r in zip(names, raws, strict=True) if r is None]
    if dead:
        conn.zrem(keys.WORKERS, *dead)
    return sorted(
        (WorkerInfo.model_validate_json(r) for r in raws if r is not None), key=lambda w: w.name
    )


def fleet_table(workers: list[WorkerInfo]) -> str:
    """A plain-text table: one line per worker, then one per (target, draft) pair."""
    if not workers:
        return "no live workers"
    lines = [f"{'worker':<20}{'host':<16}{'state':<8}{'jobs':>6}{'cache GB':>10}  models"]
    for w in workers:
        budget = f"/{w.cache_budget_gb:.1f}" if w.cache_budget_gb else ""
        models = ", ".join(f"{_short(m.name)} ({m.memory_mb:.0f} MB)" for m in w.models) or "-"
        lines.append(
            f"{w.name[:19]:<20}{w.host[:15]:<16}{w.state[:7]:<8}{w.jobs_done:>6}"
            f"{w.cache_used_gb:>6.2f}{budget:<4}  {models}"
        )
        if w.serves:
            lines.append(f"{'':<20}  serves: {'; '.join(w.serves)}")
        if (b := w.batch) is not None:
            lines.append(
                f"{'':<20}  batch: {b.size} job(s) on {_short(b.model)}, limit {b.limit} "
                f"(--max-batch {w.max_batch}; {b.reason}); KV cache {b.kv_mb:.1f} MB, up to "
                f"{b.kv_projected_mb:.1f} of {b.kv_room_mb:.1f} MB free"
            )
        if w.peak_batch > 1:
            lines.append(
                f"{'':<20}  batches: up to {w.peak_batch} jobs, KV cache up to "
                f"{w.peak_kv_mb:.1f} MB (--max-batch {w.max_batch})"
            )
        if (pc := w.prefix_cache) is not None:
            rate = f"{pc.hit_rate:.0%}" if pc.hit_rate is not None else "-"
            lines.append(
                f"{'':<20}  prefix cache: {pc.entries} prefix(es), {pc.used_mb:.0f}/"
                f"{pc.budget_mb:.0f} MB, hit rate {rate} ({pc.hits}/{pc.lookups} jobs), "
                f"{pc.tokens_reused} tokens reused"
            )
        if w.preemptions:
            lines.append(
                f"{'':<20}  preempted {w.preemptions} batch job(s) for interactive ones "
                "(back to their queue, run again)"
            )
        if w.group_size > 1 or w.kv_bits:
            group = (
                f"a group of {w.group_size} ranks (--shard {w.shard})" if w.group_size > 1 else ""
            )
            bits = f"KV caches at {w.kv_bits} bits" if w.kv_bits else ""
            lines.append(f"{'':<20}  " + "; ".join(x for x in (group, bits) if x))
        if w.machine_kind:
            lines.append(
                f"{'':<20}  figures: shared as {w.machine_kind}; {w.figures_adopted} "
                "measurement(s) taken from the fleet (producer policy show)"
            )
        for p in w.pairs:
            tps = f"{p.tokens_per_s:.1f} tok/s" if p.tokens_per_s else "-"
            acc = f", acceptance {p.acceptance_rate:.2f}" if p.acceptance_rate is not None else ""
            pair = _short(p.target) + (f" + {_short(p.draft)}" if p.draft else "")
            lines.append(f"{'':<20}  {pair}: {p.jobs} job(s), {tps}{acc}")
    return "\n".join(lines)


def _short(name: str) -> str:
    return name if len(name) <= 40 else "..." + name[-37:]
