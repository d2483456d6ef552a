"""What the fleet believes (``producer policy``): the shared figures workers keep in Redis.

Reads ``schemas.figures``' index and each scope's entries, merges them as a
worker would, and forgets them on request (``producer policy reset``).
"""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import ValidationError
from redis import Redis

from schemas.figures import (
    INDEX,
    LOOKUP_ID,
    PairFigures,
    ScopeLabel,
    TargetFigures,
    merge,
    read_entries,
    scope_key,
)


@dataclass
class Belief:
    """One scope: a target on one machine kind and mlx version, merged over its workers."""

    scope: str
    label: ScopeLabel
    workers: int
    figures: TargetFigures | None
    skipped: list[str]


def beliefs(conn: Redis, prune: bool = True) -> tuple[list[Belief], list[str]]:
    """Every scope the index lists, and what was skipped; ``prune`` drops expired scopes
    from the index (a write: not for read-only users such as the metrics exporter)."""
    index = conn.hgetall(INDEX)
    labels: dict[str, ScopeLabel] = {}
    notes: list[str] = []
    for raw_scope, raw in index.items():
        scope = raw_scope.decode(errors="replace")
        try:
            labels[scope] = ScopeLabel.model_validate_json(raw)
        except ValidationError:
            notes.append(f"index entry {scope[:40]!r} is not a scope label: ignored")
    pipe = conn.pipeline(transaction=False)
    for scope in labels:
        pipe.hgetall(scope_key(scope))
    out, gone = [], []
    for (scope, label), raw in zip(labels.items(), pipe.execute(), strict=True):
        if not raw:
            gone.append(scope)
            continue
        entries, skipped = read_entries(raw, label.target_id, label.kind, label.mlx)
        out.append(Belief(scope, label, len(entries), merge(entries), skipped))
    if gone and prune:
        conn.hdel(INDEX, *gone)
    return sorted(out, key=lambda b: (b.label.target, b.label.kind)), notes


def names_of(belief: Belief) -> set[str]:
    """Every name the scope's models had (target, drafts, adapters)."""
    names = {belief.label.target}
    if belief.figures is not None:
        names |= set(belief.figures.names.values())
    return names


def reset(conn: Redis, model: str | None = None) -> int:
    """Forget the figures of every scope (``model`` None) or of the scopes where ``model``
    was the target, a draft or an adapter. Returns the scopes forgotten."""
    if model is None:
        scopes = [s.decode() for s in conn.hkeys(INDEX)]
    else:
        scopes = [b.scope for b in beliefs(conn)[0] if model in names_of(b)]
    if scopes:
        pipe = conn.pipeline(transaction=False)
        pipe.delete(*(scope_key(s) for s in scopes))
        pipe.hdel(INDEX, *scopes)
        pipe.execute()
    return len(scopes)


def _pair_line(name: str, pair: PairFigures) -> str:
    parts = []
    if 0 in pair.arms:
        parts.append(f"plain {pair.arms[0].value:.1f} tok/s")
    rounds = {k: m for k, m in pair.arms.items() if k > 0}
    if rounds:
        seen = pair.accepted + pair.rejected
        acc = f"acceptance {pair.accepted / seen:.2f}, " if seen > 0 else ""
        ks = ", ".join(f"k={k} {m.value * 1e3:.1f} ms/round" for k, m in sorted(rounds.items()))
        parts.append(acc + ks)
    jobs = sum(m.runs for m in pair.arms.values())
    return f"  + {name}: {'; '.join(parts)} ({jobs} job(s))"


def beliefs_table(found: list[Belief], notes: list[str]) -> str:
    """Per target and machine kind: each draft's figures and the batch speeds by size."""
    if not found:
        return "\n".join([*notes, "no shared figures (workers run with --share-figures)"])
    lines = list(notes)
    for b in found:
        f = b.figures
        lines.append(
            f"{b.label.target} on {b.label.kind} (mlx {b.label.mlx}): "
            f"{b.workers} worker process(es)"
        )
        lines += [f"  ignored: {s}" for s in b.skipped]
        if f is None:
            continue
        for draft_id, pair in sorted(f.pairs.items()):
            name = "prompt lookup" if draft_id == LOOKUP_ID else f.names.get(draft_id, draft_id)
            lines.append(_pair_line(name, pair))
        for batch in f.batches:
            if not batch.by_size:
                continue
            kind = "plain" if batch.draft is None else f.names.get(batch.draft, batch.draft)
            if batch.draft == LOOKUP_ID:
                kind = "prompt lookup"
            k = "" if batch.draft is None else (" k per round" if batch.k < 0 else f" k={batch.k}")
            sizes = ", ".join(f"{n}: {m.value:.0f}" for n, m in sorted(batch.by_size.items()))
            adapter = "" if batch.adapter == "-" else f" (adapter {f.names.get(batch.adapter)})"
            lines.append(f"  batches, {kind}{k}{adapter}: tok/s by size {sizes}")
    return "\n".join(lines)
