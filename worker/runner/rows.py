"""A lane's rows: a job in a lane's engine, as one sequence or as its n choices.

A job asking for n > 1 choices is n sequences of the engine, tagged ``id`` (choice 0)
and ``id#i`` (:func:`choice_tag`): its prompt but the last token is prefilled once and
each choice starts from its own copy (:func:`add_choices`, as
``ChatGenerator.generate_choices`` runs them alone); it ends when every choice has
(:meth:`Row.took`), or all its choices leave together (:func:`remove_choices`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from worker.engine.generator import ChatGenerator, choices_of, with_choices
from worker.engine.output import GenerationOutput
from worker.engine.protocol import Engine
from worker.engine.request import Prepared
from worker.lifecycle.held import Job
from worker.runner.streamer import JobStream
from worker.schedule.route import Route


@dataclass
class Row:
    job: Job
    route: Route
    peak: int = 1  # the most sequences decoding together while this one ran
    stream: JobStream | None = None  # a streamed job's chunks (never preempted: no restart)
    n: int = 1  # its choices: a sequence each in the engine (:func:`choice_tag`)
    outs: dict[int, GenerationOutput] = field(default_factory=dict)  # choices ended
    began: float = field(default_factory=time.perf_counter)  # its choices' time runs from

    def tags(self) -> list[str]:
        """Its sequences' tags in the engine, choice 0 first."""
        return [choice_tag(self.job.id, i) for i in range(self.n)]

    def took(self, i: int, out: GenerationOutput) -> GenerationOutput | None:
        """Choice ``i`` ended with ``out``: the job's whole output once every choice has
        (choice 0's, the others in ``others``), else None."""
        self.outs[i] = out
        if len(self.outs) < self.n:
            return None
        if self.n == 1:
            return out
        outs = [self.outs[c] for c in range(self.n)]
        return with_choices(outs, time.perf_counter() - self.began)


def choice_tag(job_id: str, i: int) -> str:
    """The engine's tag of a job's choice ``i``: its id for choice 0 (and a job of one),
    ``id#i`` for the others (job ids hold no ``#``: ``schemas.keys``)."""
    return job_id if i == 0 else f"{job_id}#{i}"


def tag_owner(tag: str) -> tuple[str, int]:
    """The job id and choice of an engine's tag (:func:`choice_tag`)."""
    job_id, _, i = tag.partition("#")
    return job_id, int(i) if i else 0


def add_choices(
    engine: Engine, generator: ChatGenerator, job_id: str, job: Prepared, n: int, first: bool
) -> None:
    """``job``'s n choices into ``engine`` as n sequences: all of its prompt but the last
    token prefilled once (now, unbudgeted), each choice from its own copy (with a seed,
    choice i draws from seed + i). None is left in when one cannot be added."""
    added: list[str] = []
    starts, held = generator.choice_starts(job, n)
    try:
        for i, choice in enumerate(choices_of(job, n)):
            engine.add(choice_tag(job_id, i), choice, starts[i], first=first)
            added.append(choice_tag(job_id, i))
    except BaseException:
        for tag in added:
            engine.remove(tag)
        raise
    finally:
        held()


def remove_choices(engine: Engine, row: Row, but: int | None = None) -> list[GenerationOutput]:
    """``row``'s choices still in ``engine`` (all but ``but``) leave it: what each of its
    choices made so far, by choice (those that ended, as they ended)."""
    made = []
    for i, tag in enumerate(row.tags()):
        out = row.outs.get(i)
        if out is None and i != but:
            out = engine.remove(tag)
        if out is not None:
            made.append(out)
    return made
