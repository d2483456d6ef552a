"""Which jobs may share a continuous batch, and on what terms.

A job may share a batch (:func:`batchable`): streamed, seeded or not, and with n > 1
choices (n sequences of a plain batch, their prompt prefilled once, even when it names a
draft), unless it samples one choice with a seed and speculates. A seeded sampling job
(choice i of n: seed + i) draws from its own random key on every path
(``worker.engine.sampling.KeyedSampler``), so it samples the same text alone or among
others. Jobs share a batch when their :class:`BatchKey` is equal: same (model, adapter),
and for jobs that name a draft, what the speculation policy decided
(``worker.schedule.route``): batched without the draft, or in a speculative batch with
it at k.
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


def batchable(req: ChatRequest, proposer: str | None = None) -> bool:
    """Whether a request may share a batch at all: not when it samples one choice with a
    seed and a ``proposer`` (a draft or prompt lookup: how many tokens it proposes a
    round, and so its random draws, would depend on the rows beside it; alone they do
    not). A job's n > 1 choices decode plainly, so they share a plain batch."""
    seeded = req.seed is not None and req.temperature > 0
    return proposer is None or req.n > 1 or not seeded
