"""The policy's measurements to and from the fleet's figures (``schemas.figures``).

- :func:`export`: what this worker measured itself on one target, by identity
  (figures it took from the fleet are left out, so no worker counts another's twice);
- :func:`adopt`: the fleet's merged figures into what a policy has not measured itself
  (arms, acceptance, batch kinds), so its first decision is the fleet's (no
  "measuring" jobs) and nothing it measured is replaced.

Pure Python: identities come from the caller (``worker.runner.figures``), which
reads and writes Redis.
"""

from __future__ import annotations

from collections.abc import Callable

from schemas.figures import (
    LOOKUP_ID,
    MTP_ID,
    NO_ADAPTER,
    BatchFigures,
    Measured,
    PairFigures,
    TargetFigures,
)
from worker.schedule.batchsize import PLAIN, BatchRates
from worker.schedule.estimators import Acceptance, Running
from worker.schedule.policy import LOOKUP, PairStats, SpeculationPolicy

#: A name's identity (weights), or None when it is not known.
Identify = Callable[[str], str | None]


def proposer_id(proposer: str, identify: Identify) -> str | None:
    if proposer == LOOKUP:
        return LOOKUP_ID
    return MTP_ID if proposer == MTP_ID else identify(proposer)  # (no weights of its own)


def adapter_id(adapter: str | None, identify: Identify) -> str | None:
    return NO_ADAPTER if adapter is None else identify(adapter)


def _own(m: Running) -> Measured | None:
    return Measured(value=m.value, runs=m.own) if m.own > 0 and m.value >= 0 else None


def _seeded(m: Measured) -> Running:
    return Running(value=m.value, runs=m.runs, seeded=m.runs)


def _own_sizes(rates: BatchRates | None) -> dict[int, Measured]:
    if rates is None:
        return {}
    return {n: own for n, a in rates.by_size.items() if (own := _own(a)) is not None}


def export(
    policy: SpeculationPolicy,
    target: str,
    identify: Identify,
    *,
    worker: str,
    kind: str,
    mlx: str,
    now: float,
) -> TargetFigures | None:
    """What this worker measured itself on ``target`` (None: nothing, or no identity)."""
    target_id = identify(target)
    if target_id is None:
        return None
    names = {target_id: target}
    pairs: dict[str, PairFigures] = {}
    with policy.lock:
        for (t, draft), pair in list(policy.pairs.items()):
            did = proposer_id(draft, identify) if t == target else None
            arms = {k: own for k, a in pair.arms.items() if (own := _own(a)) is not None}
            if did is None or not arms:
                continue
            spec = pair.own_spec_jobs > 0
            pairs[did] = PairFigures(
                arms=arms,
                accepted=pair.accept.accepted if spec else 0.0,
                rejected=pair.accept.rejected if spec else 0.0,
                jobs=pair.own_spec_jobs,
            )
            names[did] = draft
    batches: list[BatchFigures] = []
    sizes = policy.sizes
    with sizes.lock:
        kinds = {(a, None, PLAIN) for t, a in sizes.plain if t == target}
        kinds |= {(a, d, k) for t, a, d, k in sizes.spec if t == target}
        kinds |= {(a, d, k) for t, a, d, k in sizes.whole if t == target}
        for adapter, draft, k in kinds:
            aid = adapter_id(adapter, identify)
            did = None if draft is None else proposer_id(draft, identify)
            if aid is None or (draft is not None and did is None):
                continue
            if draft is None:
                rates = sizes.plain.get((target, adapter))
            else:
                rates = sizes.spec.get((target, adapter, draft, k))
            whole = sizes.whole.get((target, adapter, draft, k))
            by_size = _own_sizes(rates)
            own_whole = _own(whole) if whole is not None else None
            if by_size or own_whole:
                batches.append(
                    BatchFigures(adapter=aid, draft=did, k=k, by_size=by_size, whole=own_whole)
                )
                if adapter is not None:
                    names[aid] = adapter
                if draft is not None and did is not None:
                    names[did] = draft
    if not pairs and not batches:
        return None
    return TargetFigures(
        worker=worker,
        at=now,
        target=target_id,
        kind=kind,
        mlx=mlx,
        pairs=pairs,
        batches=batches,
        names=names,
    )


def adopt(
    policy: SpeculationPolicy,
    target: str,
    adapter: str | None,
    proposer: str | None,
    figures: TargetFigures,
    identify: Identify,
) -> int:
    """Take the fleet's ``figures`` for what (``target``, ``adapter``, ``proposer``) jobs
    run, where this policy has not measured it itself: an arm, the acceptance, a batch
    kind's sizes or whole batches. Returns the measurements taken (0: nothing new)."""
    pid = None if proposer is None else proposer_id(proposer, identify)
    aid = adapter_id(adapter, identify)
    taken = 0
    with policy.lock:
        fleet = figures.pairs.get(pid) if pid is not None else None
        pair = policy.pairs.get((target, proposer)) if proposer is not None else None
        if proposer is not None and fleet and fleet.arms:
            if pair is None:
                pair = policy.pairs.setdefault((target, proposer), PairStats())
            for k, m in fleet.arms.items():  # the arms not measured here
                if not pair.arms.get(k, Running()).runs:
                    pair.arms[k] = _seeded(m)
                    pair.fleet_jobs += m.runs
                    taken += m.runs
            if not pair.accept.seen:
                pair.accept = Acceptance(fleet.accepted, fleet.rejected)
    if aid is None:
        return taken
    sizes = policy.sizes
    with sizes.lock:
        for b in figures.batches:
            if b.adapter != aid or (b.draft is not None and b.draft != pid):
                continue
            draft = None if b.draft is None else proposer
            if draft is None:
                have = sizes.plain.setdefault((target, adapter), BatchRates())
            else:
                have = sizes.spec.setdefault((target, adapter, draft, b.k), BatchRates())
            if not have.by_size and b.by_size:
                have.by_size = {n: _seeded(m) for n, m in b.by_size.items()}
                taken += sum(m.runs for m in b.by_size.values())
            whole_key = (target, adapter, draft, b.k if draft is not None else PLAIN)
            if b.whole is not None and whole_key not in sizes.whole:
                sizes.whole[whole_key] = _seeded(b.whole)
    return taken
