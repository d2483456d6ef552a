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

from schemas import ChatRequest
from worker.engine.generator import ChatGenerator
from worker.engine.request import Prepared

#: How many queued jobs a job that shares nothing known yet is compared with.
PEEK = 4

#: The requests of the jobs waiting next in the queue (read, not taken).
Upcoming = Callable[[], list[ChatRequest]]


def company(generator: ChatGenerator, job: Prepared, upcoming: Upcoming | None) -> list[list[int]]:
    """The prompts of the upcoming jobs on ``job``'s model and adapter, when ``job`` has no
    known shared prefix (else none: what it shares is known)."""
    if upcoming is None or job.request is None or generator.shares(job):
        return []
    mine = (job.request.model, job.request.adapter)
    prompts = []
    for other in upcoming():
        if (other.model, other.adapter) != mine:
            continue
        try:
            prompts.append(generator.prompt_of(other))
        except Exception:  # a request that does not render fails later, as its own job
            continue
    return prompts
