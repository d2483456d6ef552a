"""A job's company: the prompts of the jobs queued right after it on the same model.

The prefix cache keeps what jobs' prompts share, on token ids (``worker.engine.prefix``).
A job whose prompt shares nothing known yet (no kept entry, no recent prompt, no
message boundary) is compared with the next few jobs of its queue: the first job of a
group then prefills what the group shares once and keeps it, and the rest of the group
reuses it. Only these jobs read the queue (a few job hashes, one round trip), and none
of them is taken or changed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from schemas import ChatRequest
from schemas.embeddings import EmbeddingRequest
from worker.engine.generator import ChatGenerator
from worker.engine.prefix import MIN_TOKENS, common_prefix
from worker.engine.request import Prepared

#: How many queued jobs a job that shares nothing known yet is compared with.
PEEK = 4
#: After this many looks in a row found nothing to share, only every this-many-th job
#: looks (a queue of unrelated prompts pays for a read of the queue now and then).
MISSES = 8

#: The requests of the jobs waiting next in the queue (read, not taken).
Upcoming = Callable[[], list[ChatRequest | EmbeddingRequest]]


@dataclass
class Scout:
    """How the worker's recent looks at its queue went."""

    misses: int = 0  # looks in a row that found no job to share a prefix with

    def due(self) -> bool:
        return self.misses < MISSES or self.misses % MISSES == 0

    def found(self, anything: bool) -> None:
        self.misses = 0 if anything else self.misses + 1


def company(
    generator: ChatGenerator, job: Prepared, upcoming: Upcoming | None, scout: Scout
) -> list[list[int]]:
    """The prompts of the upcoming jobs on ``job``'s model and adapter that share at least
    :data:`MIN_TOKENS` with it, when ``job`` has no known shared prefix (else none: what it
    shares is known) and the ``scout`` says a look is due."""
    if upcoming is None or job.request is None or len(job.prompt) <= MIN_TOKENS:
        return []
    if generator.shares(job):
        return []
    if not scout.due():
        scout.found(False)
        return []
    mine = (job.request.model, job.request.adapter)
    prompts = []
    for other in upcoming():
        if not isinstance(other, ChatRequest) or (other.model, other.adapter) != mine:
            continue
        try:
            prompt = generator.prompt_of(other)
        except Exception:  # a request that does not render fails later, as its own job
            continue
        if common_prefix(job.prompt, prompt) >= MIN_TOKENS:
            prompts.append(prompt)
    scout.found(bool(prompts))
    return prompts
