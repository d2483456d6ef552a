"""Which jobs may share a continuous batch, and on what terms.

A job may share a batch (:func:`batchable`, streamed or not) unless it asks for n > 1
choices (a batch of its own) or samples with a seed (it runs alone so that its seed
means what it says). Jobs share a batch when their :class:`BatchKey` is equal:
same (model, adapter), and for jobs that name a draft, what the speculation policy
decided (``worker.schedule.route``): batched without the draft, or in a speculative
batch with it at k.
"""

from __future__ import annotations

from typing import NamedTuple

from schemas import ChatRequest


class BatchKey(NamedTuple):
    """Jobs share a batch when these are equal."""

    model: str
    adapter: str | None
    draft: str | None  # None: no draft (a plain batch); policy.LOOKUP: prompt lookup
    k: int  # draft tokens per round (0: plain); with ``adaptive``, the most per round
    adaptive: bool = False  # k chosen each round (``worker.schedule.goodput``)


def batchable(req: ChatRequest) -> bool:
    """Whether a request may share a batch at all (n > 1: its choices are a batch of
    their own; a seeded sampling job runs alone so that its seed means what it says)."""
    return not (req.n > 1 or (req.seed is not None and req.temperature > 0))
