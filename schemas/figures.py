"""What workers measured, shared in Redis: the speculation policy's figures per machine kind.

``--speculative auto`` and ``--max-batch auto`` decide from measurements (plain and
speculative speeds, a draft's acceptance, batch speeds by size). Workers keep them
in Redis so that a worker that starts, restarts or joins the fleet uses them at
once instead of measuring again:

- a *scope* is (machine kind, mlx version, target identity): figures from an M4
  never steer an M2 Ultra, and a model is known by its weights, not its name
  (:func:`scope_of`);
- in a scope, each worker writes only what it measured itself (:class:`TargetFigures`,
  one hash field per worker); a reader merges the fields (:func:`merge`), each
  measurement weighing by how many jobs fed it and halving every
  :data:`HALF_LIFE_S` of age, so what changed shows; older than :data:`MAX_AGE_S`,
  an entry is not used and Redis drops it;
- an entry that does not parse, is too large, or belongs to another scope is
  skipped with a warning (:func:`read_entries`): a hostile entry never fails a job.

Pure Python, no Redis or MLX: producers read the same figures (``producer policy``).
"""

from __future__ import annotations

import hashlib
import math
import time
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from schemas import keys

#: The hash of every scope's label (``producer policy``): scope -> :class:`ScopeLabel` JSON.
INDEX = keys.FIGURES
#: A measurement's weight halves every this many seconds of age.
HALF_LIFE_S = 24 * 3600.0
#: Entries older than this are not used; scopes not written for this long expire.
MAX_AGE_S = 14 * 24 * 3600
#: The most workers' entries a scope keeps (the oldest go first).
MAX_WORKERS = 32
#: An entry larger than this (bytes of JSON) is skipped.
MAX_ENTRY_BYTES = 64_000
#: A measurement weighs at most as much as this many jobs (one worker cannot outvote all).
MAX_WEIGHT_RUNS = 32
#: The identity of prompt lookup as a "draft" (it has no weights).
LOOKUP_ID = "lookup"
#: A target's own MTP head(s) as a "draft" (a job's ``draft_model: "mtp"``): the figures
#: are scoped by the target's identity already.
MTP_ID = "mtp"
#: The adapter identity of jobs without an adapter.
NO_ADAPTER = "-"

Rate = Annotated[float, Field(ge=0, allow_inf_nan=False)]
Count = Annotated[int, Field(ge=1, le=10**9)]
Id = Annotated[str, Field(min_length=1, max_length=80)]
Name = Annotated[str, Field(max_length=400)]


class Measured(BaseModel):
    """A running average and how many measurements fed it."""

    model_config = ConfigDict(extra="forbid")

    value: Rate
    runs: Count


class PairFigures(BaseModel):
    """One (target, draft) pair decoding one job at a time: plain tokens/s (k=0) and
    seconds per speculative round (k > 0), and the draft's acceptance evidence."""

    model_config = ConfigDict(extra="forbid")

    arms: dict[int, Measured] = Field(default_factory=dict, max_length=32)
    accepted: Rate = 0.0
    rejected: Rate = 0.0
    jobs: int = Field(0, ge=0, le=10**9)  # speculative jobs behind the acceptance


class BatchFigures(BaseModel):
    """One kind of batch (plain: no draft; else a draft at k, -1 meaning k per round) on
    one adapter: aggregate tokens/s by batch size, and of whole batches."""

    model_config = ConfigDict(extra="forbid")

    adapter: Id = NO_ADAPTER
    draft: Id | None = None
    k: int = Field(0, ge=-1, le=64)
    by_size: dict[int, Measured] = Field(default_factory=dict, max_length=64)
    whole: Measured | None = None


class TargetFigures(BaseModel):
    """What one worker measured itself on one target (one scope's hash field)."""

    model_config = ConfigDict(extra="forbid")

    v: Literal[1] = 1
    worker: Name
    at: Rate  # unix seconds of the write
    target: Id  # the target's identity (weights)
    kind: Name  # the machine kind
    mlx: Name  # the mlx version
    pairs: dict[Id, PairFigures] = Field(default_factory=dict, max_length=32)  # by draft id
    batches: list[BatchFigures] = Field(default_factory=list, max_length=128)
    names: dict[Id, Name] = Field(default_factory=dict, max_length=64)  # id -> a name it had


class ScopeLabel(BaseModel):
    """What a scope is, for people (``producer policy``, ``producer fleet``)."""

    model_config = ConfigDict(extra="ignore")

    target: Name  # a name the target had
    target_id: Id
    kind: Name
    mlx: Name
    at: Rate


def scope_of(kind: str, mlx: str, target_id: str) -> str:
    """The scope of figures for ``target_id`` on this machine kind and mlx version."""
    digest = hashlib.sha256(f"{kind}\0{mlx}\0{target_id}".encode()).hexdigest()[:24]
    return digest


def scope_key(scope: str) -> str:
    """A scope's hash: worker process -> :class:`TargetFigures` JSON."""
    return keys.figures_key(scope)


def read_entries(
    raw: dict[bytes, bytes] | dict[str, str],
    target_id: str,
    kind: str,
    mlx: str,
    now: float | None = None,
) -> tuple[list[TargetFigures], list[str]]:
    """The usable entries of a scope's hash, and why each other one was skipped."""
    now = time.time() if now is None else now
    good: list[TargetFigures] = []
    skipped: list[str] = []
    for field, value in raw.items():
        who = field.decode(errors="replace") if isinstance(field, bytes) else field
        if len(value) > MAX_ENTRY_BYTES:
            skipped.append(f"{who[:60]!r}: {len(value)} bytes, more than {MAX_ENTRY_BYTES}")
            continue
        try:
            entry = TargetFigures.model_validate_json(value)
        except ValidationError as e:
            skipped.append(f"{who[:60]!r}: not figures ({e.error_count()} error(s))")
            continue
        if (entry.target, entry.kind, entry.mlx) != (target_id, kind, mlx):
            skipped.append(f"{who[:60]!r}: figures of another model, machine kind or mlx")
            continue
        if now - entry.at > MAX_AGE_S:
            continue  # stale: not used, and dropped at the next write
        good.append(entry)
    return good, skipped


def _merge_measured(items: list[tuple[Measured, float]]) -> Measured | None:
    """Weighted mean of (measurement, age weight) pairs; runs add up."""
    total = sum(min(m.runs, MAX_WEIGHT_RUNS) * w for m, w in items)
    if total <= 0 or not math.isfinite(total):
        return None
    value = sum(m.value * min(m.runs, MAX_WEIGHT_RUNS) * w for m, w in items) / total
    return Measured(value=value, runs=sum(m.runs for m, _ in items))


def merge(entries: list[TargetFigures], now: float | None = None) -> TargetFigures | None:
    """What the fleet believes for one scope: every entry's figures merged (see the
    module's docstring), as one :class:`TargetFigures` (``worker`` "fleet"), or None."""
    if not entries:
        return None
    now = time.time() if now is None else now
    age = {id(e): 0.5 ** (max(now - e.at, 0.0) / HALF_LIFE_S) for e in entries}
    pairs: dict[str, PairFigures] = {}
    for draft in {d for e in entries for d in e.pairs}:
        held = [(e.pairs[draft], age[id(e)]) for e in entries if draft in e.pairs]
        arms = {}
        for k in {k for p, _ in held for k in p.arms}:
            m = _merge_measured([(p.arms[k], w) for p, w in held if k in p.arms])
            if m is not None:
                arms[k] = m
        weights = [(p, min(p.jobs, MAX_WEIGHT_RUNS) * w) for p, w in held if p.jobs]
        total = sum(w for _, w in weights)
        accepted = sum(p.accepted * w for p, w in weights) / total if total > 0 else 0.0
        rejected = sum(p.rejected * w for p, w in weights) / total if total > 0 else 0.0
        pairs[draft] = PairFigures(
            arms=arms, accepted=accepted, rejected=rejected, jobs=sum(p.jobs for p, _ in held)
        )
    batches = []
    kinds = {(b.adapter, b.draft, b.k) for e in entries for b in e.batches}
    for adapter, draft, k in sorted(kinds, key=str):
        held_b = [
            (b, age[id(e)])
            for e in entries
            for b in e.batches
            if (b.adapter, b.draft, b.k) == (adapter, draft, k)
        ]
        sizes = {}
        for n in {n for b, _ in held_b for n in b.by_size}:
            m = _merge_measured([(b.by_size[n], w) for b, w in held_b if n in b.by_size])
            if m is not None:
                sizes[n] = m
        whole = _merge_measured([(b.whole, w) for b, w in held_b if b.whole is not None])
        batches.append(BatchFigures(adapter=adapter, draft=draft, k=k, by_size=sizes, whole=whole))
    first = max(entries, key=lambda e: e.at)
    names: dict[str, str] = {}
    for e in sorted(entries, key=lambda e: e.at):
        names |= e.names
    return TargetFigures(
        worker="fleet",
        at=first.at,
        target=first.target,
        kind=first.kind,
        mlx=first.mlx,
        pairs=pairs,
        batches=batches,
        names=names,
    )


def measurements(figures: TargetFigures) -> int:
    """How many measurements the figures rest on: jobs measured one at a time, and
    batch speed reports (one per 16 decoding steps of a batch size)."""
    arms = sum(m.runs for p in figures.pairs.values() for m in p.arms.values())
    sizes = sum(m.runs for b in figures.batches for m in b.by_size.values())
    return arms + sizes
