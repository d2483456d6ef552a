"""What an engine is: sequences join, each step advances them, finished ones come out.

Every engine (a job alone, plain or speculative; a continuous batch on one model; a
speculative batch on a target and its draft) has this interface, so whatever runs one
(``worker.runner``, :func:`run_to_end`) runs any of them; each advances the one
sequence type (``worker.engine.sequence``). Anchors:
vLLM v1's EngineCore (add_request / step -> typed outputs / abort) and mlx-lm's
BatchGenerator (insert / next / remove).
"""

from __future__ import annotations

from collections.abc import Generator, Hashable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from schemas import MlxqError
from worker.engine.models import LoadedModel
from worker.engine.output import GenerationOutput
from worker.engine.request import Prepared
from worker.engine.sequence import OnText

#: A finished sequence: its tag and its output, or what failed it (it alone).
Finished = tuple[Hashable, GenerationOutput | MlxqError]


class CannotTake(Exception):
    """An engine cannot hold this sequence (a cache type, a shape): raised by ``add``
    before anything changes, naming why. The job must go to a path that can run it."""


@dataclass(frozen=True)
class Start:
    """Where a sequence's prompt starts: a KV cache holding its first ``cached`` tokens
    (the models' layers in order; None: from nothing), and how many of them count as
    reused (taken from the prefix cache, reported as ``cached_tokens``); ``source``: the
    tokens of the kept entry the target's layers come from (a worker group's other ranks
    start from their part of it)."""

    cache: list[Any] | None = None
    cached: int = 0
    reused: int = 0
    source: tuple[int, ...] = ()


#: A prompt that starts from nothing (no kept prefix).
NO_START = Start()


@dataclass
class Step:
    """What one step did."""

    tokens: int  # tokens decoded (one per decoding sequence; more when speculative)
    done: list[Finished]  # sequences that finished, with their outputs
    prefilled: bool  # whether prompt chunks were prefilled in this step too
    decoding: int = -1  # sequences that decoded (-1: as many as ``tokens``)

    @property
    def sequences(self) -> int:
        return self.tokens if self.decoding < 0 else self.decoding


class DraftPlanner(Protocol):
    """Chooses each round's draft length for a speculative batch, from what it observes
    (``worker.schedule.goodput.Goodput``)."""

    def plan(self, tags: Sequence[Hashable], remaining: Sequence[int]) -> int:
        """This round's k for the rows ``tags`` with ``remaining`` tokens left each."""
        ...

    def observe(
        self,
        tags: Sequence[Hashable],
        accepted: Sequence[int],
        proposed: Sequence[int],
        k: int,
        times: tuple[float, float, float],
        emitted: int,
    ) -> None:
        """One round's outcome: per row accepted of proposed; k; (draft, verify, total)
        seconds; tokens emitted."""
        ...


class Engine(Protocol):
    """Sequences on loaded models, advanced together one step at a time."""

    #: The models whose KV caches each sequence holds (the target first).
    models: tuple[LoadedModel, ...]

    def __len__(self) -> int:
        """Sequences held (joining or decoding)."""
        ...

    @property
    def kv_bytes(self) -> int:
        """Bytes the sequences' KV caches hold now."""
        ...

    @property
    def prefill_steps(self) -> int:
        """Steps still to carry prompt chunks of the sequences held, about (0: the next
        steps only decode): what a sequence joining now waits for at each token."""
        ...

    def add(
        self,
        tag: Hashable,
        job: Prepared,
        start: Start = NO_START,
        on_text: OnText | None = None,
        first: bool = False,
    ) -> None:
        """A sequence joins (it is prefilled at the next step); ``tag`` names it.
        ``on_text`` receives its text as it grows (``worker.engine.sequence.OnText``).
        ``first``: prefilled before sequences that joined earlier and wait still.
        Raises :class:`CannotTake` (and changes nothing) if this engine cannot hold it."""
        ...

    def step(self) -> Step:
        """One step for every sequence held (prefilling those that joined)."""
        ...

    def remove(self, tag: Hashable) -> GenerationOutput | None:
        """Stop the sequence ``tag`` now: what it made so far (``Sequence.cut_short``; None if
        this engine does not hold it)."""
        ...

    def lengths(self) -> dict[Hashable, tuple[int, int]]:
        """(tokens held, tokens it may still add) of each sequence, by tag: what admission
        projects."""
        ...

    def first_token_at(self, tag: Hashable) -> float | None:
        """When the sequence ``tag`` produced its first token (perf_counter), if it has."""
        ...

    def close(self) -> None:
        """Let go of every sequence and its caches."""
        ...


class Stop(Protocol):
    """What may stop a running job (``worker.runner.stops.JobStop``: a cancel, a time limit)."""

    def check(self) -> None:
        """Raise the :class:`~schemas.MlxqError` that stops the job now, if any."""
        ...


class Stopped(Exception):
    """A job was stopped while it ran: ``error`` says why, ``outputs`` hold what each of its
    sequences had made (by tag, cut: ``worker.engine.sequence.CUT``)."""

    def __init__(self, error: MlxqError, outputs: dict[Hashable, GenerationOutput]) -> None:
        super().__init__(str(error))
        self.error, self.outputs = error, outputs


T = TypeVar("T")
#: A run a step at a time: it yields before each step of its engine, returning its result.
Steps = Generator[None, None, T]


def drive(steps: Steps[T]) -> T:
    """Run ``steps`` to its end: its result."""
    while True:
        try:
            next(steps)
        except StopIteration as end:
            return end.value


def run_to_end(
    engine: Engine, stop: Stop | None = None, tags: Sequence[Hashable] = (0,)
) -> dict[Hashable, GenerationOutput]:
    """Step ``engine`` until every sequence it holds (``tags``) has ended (:func:`steps_to_end`)."""
    return drive(steps_to_end(engine, stop, tags))


def steps_to_end(
    engine: Engine, stop: Stop | None = None, tags: Sequence[Hashable] = (0,)
) -> Steps[dict[Hashable, GenerationOutput]]:
    """Step ``engine`` until every sequence it holds (``tags``) has ended, yielding before
    each step (a worker's loop steps other lanes between): their outputs by tag. A
    sequence's failure is raised (an :class:`~schemas.MlxqError`); ``stop`` is checked at
    every step, and what it raises ends the run as :class:`Stopped`, with what each
    sequence still held had made. The engine is closed either way (closing the steps
    too)."""
    outs: dict[Hashable, GenerationOutput] = {}
    try:
        while len(engine):
            yield
            for tag, out in engine.step().done:
                if isinstance(out, MlxqError):
                    raise out
                outs[tag] = out
            if stop is not None and len(engine):
                try:
                    stop.check()
                except MlxqError as e:
                    for tag in tags:
                        if tag not in outs and (cut := engine.remove(tag)) is not None:
                            outs[tag] = cut
                    raise Stopped(e, outs) from None
    finally:
        engine.close()
    return outs
