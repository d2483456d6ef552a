"""KV memory a running job or batch may grow to: the engine's measured profiles meet the
scheduler's projection (``worker.schedule.admission``)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from worker.engine.generator import ChatGenerator
from worker.engine.models import LoadedModel
from worker.engine.protocol import Engine
from worker.schedule.admission import batch_peak_bytes


def projected(models: Iterable[LoadedModel], lengths: Sequence[tuple[int, int]]) -> int:
    """The most the KV caches of ``lengths`` ((held, still to come) per sequence) can hold
    on every model in ``models`` (a speculative job's draft too)."""
    return sum(batch_peak_bytes(m.kv, lengths) for m in models)


def kv_models(engine: Engine, generator: ChatGenerator) -> list[LoadedModel]:
    """The models whose KV caches ``engine`` holds: its own, and a drafter's."""
    drafter = generator.drafter_entry
    return [*engine.models, *([drafter] if drafter is not None else [])]
