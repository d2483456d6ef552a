"""A job's route: how it runs, decided once when it is taken.

Pure Python. :func:`route` asks the speculation policy every question about a job
(what proposes its tokens, whether the job fixes k, which batch it may join, plain or
speculative and why) and returns a :class:`Route` that travels with the job through
the runner to its record; nothing downstream asks the policy again. A job taken into a
running batch is routed once too (``decide_alone=False``: if it cannot join, it goes
back to its queue and is routed again when taken again).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from schemas import ChatRequest
from worker.schedule.grouping import BatchKey, batchable
from worker.schedule.policy import LOOKUP, Decision, SpeculationPolicy


@dataclass(frozen=True)
class Route:
    """How one job runs."""

    #: What proposes its speculative tokens: the draft model it names, ``LOOKUP``, or None.
    proposer: str | None = None
    #: The draft length the job fixes itself (``num_draft_tokens``), if any.
    fixed_k: int | None = None
    #: The batch it joins; None: it runs alone.
    batch: BatchKey | None = None
    #: How the policy runs it (plain or speculative, k, why); None without a proposer.
    decision: Decision | None = None
    #: Jobs waiting in its queue when it was routed, itself included (1: not asked).
    depth: int = 1

    @property
    def speculative(self) -> bool:
        return self.decision is not None and self.decision.speculative

    @property
    def method(self) -> str | None:
        """``speculation_method`` of its record: "draft", "prompt_lookup", or None."""
        if not self.speculative:
            return None
        return "prompt_lookup" if self.proposer == LOOKUP else "draft"

    def with_decision(self, decision: Decision | None) -> Route:
        return dataclasses.replace(self, decision=decision)


def route(
    req: ChatRequest,
    policy: SpeculationPolicy,
    depth: Callable[[], int] | int = 1,
    *,
    batching: bool = True,
    decide_alone: bool = True,
) -> Route:
    """Route ``req``: the batch it may join (only when ``batching``; ``depth``, the jobs
    waiting, is read only for a job with a proposer) or alone, and the policy's decision.

    A job alone gets its decision from :meth:`SpeculationPolicy.choose` (which counts the
    job towards the policy's probes, so only when ``decide_alone``: the job will run)."""
    proposer = policy.proposer(req)  # a draft, prompt lookup, or nothing
    policy.first_use(req.model, req.adapter, proposer)  # the fleet's figures, once
    fixed = policy.fixed_k(req)
    waiting = 1
    if batching and batchable(req, proposer):
        if proposer is not None and req.n > 1:  # (its choices decode plainly anyway)
            choices = Decision(0, f"n={req.n}: the choices decode plainly, batched")
            return Route(proposer, fixed, BatchKey(req.model, req.adapter, None, 0), choices)
        if proposer is None:
            return Route(None, fixed, BatchKey(req.model, req.adapter, None, 0))
        waiting = depth() if callable(depth) else depth
        decision = policy.batch_instead(req.model, proposer, req.adapter, waiting, fixed)
        if decision is not None:
            draft = proposer if decision.speculative else None
            key = BatchKey(req.model, req.adapter, draft, decision.k, decision.adaptive)
            return Route(proposer, fixed, key, decision, waiting)
    if proposer is None or not decide_alone:
        return Route(proposer, fixed, None, None, waiting)
    if req.n > 1:
        decision = Decision(0, f"n={req.n}: the choices decode as one batch, plainly")
    else:
        decision = policy.choose(req.model, proposer, fixed)
    return Route(proposer, fixed, None, decision, waiting)
