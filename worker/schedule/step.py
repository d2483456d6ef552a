"""The step rules of a running batch, pure (no Redis, no MLX), with every constant in one place.

Each turn of the worker's loop (``worker.runner.lanes``) asks :func:`plan`: which lane
steps (the batch's, or the side lane of jobs from queues ahead, within the batch's
floor), how much prompt it may prefill (:func:`prefill_budget`), and whether to look at
the queues ahead. For each job found there it asks:

- :func:`where`: where does a job waiting ahead (``mlxq.interactive``) run: joining
  the batch, in a side lane, alone between two steps, or later? It reads
  :func:`joins` (join, or run beside?) and :func:`place_for_one` (a place, or does a
  batch job give one up?).
- :func:`preempt_for_room` (down to :func:`kept_rows`): which of the batch's own rows
  leave so that a job from a queue ahead fits in memory.
- :func:`owed_after_beside` / :func:`owed_after_step`: the batch's floor (it keeps
  ``batch_floor`` of the time; it runs a little ahead while none wait);
  :func:`side_lane_free` / :func:`side_turn`: a side lane for a job, the next to step.

and before each take, :func:`model_waits` (how long a job for a model not loaded may be
passed over; the take script applies it). Each reads a :class:`BatchView` and the frozen
:class:`StepConfig` (``WorkerRuntime.step``) and returns a decision the runner applies.
"""

from __future__ import annotations

from collections.abc import Collection, Hashable, Sequence
from dataclasses import dataclass
from typing import Literal

from schemas import keys

#: ``--interactive-join``: the measured rule, or the operator's choice.
JOIN_MODES = ("auto", "always", "never")
#: Seconds a job for a model not loaded may be passed over for jobs of a loaded one
#: (``--model-wait``): about what a load costs a Mac several times over.
DEFAULT_MODEL_WAIT_S = 30.0


@dataclass(frozen=True)
class StepConfig:
    """Every constant the step rules use, with the reason each has its value."""

    #: An interactive job joins while a step costs at most this many steps at the
    #: smallest size measured (above: a compute-bound device; it runs beside instead).
    join_slowdown: float = 2.0
    #: The largest batch size whose measured step stands for one sequence's.
    small_size: int = 2
    #: ``--interactive-join``: "auto" (the rule above), "always" or "never".
    join_mode: str = "auto"
    #: The share of a batch's slots its own queue's jobs keep when interactive jobs take
    #: places (at least one slot).
    own_floor: float = 0.25
    #: The batch's floor: the least share of the time its lane steps while jobs from
    #: queues ahead run beside it (so a flood of requests cannot stop it).
    batch_floor: float = 0.25
    #: Step seconds the batch may run ahead of its floor while none wait ahead (requests
    #: that come together then run back to back).
    floor_credit_s: float = 2.0
    #: Seconds of prompt prefill a step takes at most while someone may wait on it (the
    #: plan turns it into tokens at the prefill speed measured).
    prefill_budget_s: float | None = 0.5
    #: Seconds after an interactive job was last seen waiting that the budget holds
    #: (requests come in streams).
    quiet_s: float = 5.0
    #: Seconds of prompt prefill a plain batch's step takes at most while nobody waits
    #: (larger chunks; a request arriving meanwhile waits at most that step).
    quiet_budget_s: float = 4.0
    #: The most side lanes (batch keys: models, or a model's plain and speculative jobs)
    #: live beside a batch; a job for another key runs alone between two steps.
    side_lanes: int = 3

    def __post_init__(self) -> None:
        if self.join_mode not in JOIN_MODES:
            raise ValueError(f"join mode must be one of {JOIN_MODES}, not {self.join_mode!r}")


@dataclass(frozen=True)
class BatchView:
    """What the step rules read of one running batch."""

    size: int = 0  # sequences held (a row each; a job's n choices are n)
    cap: int = 256  # the most sequences it may hold (``--max-batch N``, or the auto cap)
    limit: int = 256  # the sequences it takes from its queue now (``--max-batch``, measured)
    own: int = 0  # rows from the batch's own queue (the others came from queues ahead)
    step_s: float | None = None  # its steps' seconds, prefills too (running average)
    decode_s: float | None = None  # its steps' seconds that only decoded (running)
    smallest_step_s: float | None = None  # a step at the smallest size measured (<= small)
    prefill_steps: int = 0  # steps still to carry prompt chunks of its rows, about
    in_group: bool = False  # a worker group's (its ranks step alike; no side batch)
    beside: int = 0  # sequences of the side lanes beside it
    since_ahead_s: float = float("inf")  # since a job was last seen waiting ahead
    owed: float = 0.0  # step seconds the batch is owed by work beside it (< 0: ahead)
    ahead: bool = False  # queues are served before the batch's (and the worker may take)
    look_due: bool = True  # the last look at them is old enough to look again
    budgeted: bool = False  # its prefill may be cut per step (not in a worker group)
    prefill_rate: float | None = None  # prompt tokens/s its engine measured (None: none yet)


def joins(view: BatchView, cfg: StepConfig) -> bool:
    """Whether an interactive job joins the batch (else it runs beside it). On a GPU a
    batch step costs little more than one sequence's; on a CPU a large batch's costs many:
    it joins while a step costs at most ``join_slowdown`` steps at the smallest size
    measured (up to ``small_size``; with none that small it runs beside, whose steps then
    measure small sizes; in a worker group, which has no side batch, it joins). While
    other prompts prefill for more than the next step its tokens would wait for steps
    that carry their chunks: the steps measured with them count, and with nothing to
    compare them to it does not join. Otherwise the steps that only decoded count (none
    yet: every step so far; no step at all: it joins)."""
    if cfg.join_mode != "auto":
        return cfg.join_mode == "always"
    smallest = view.smallest_step_s
    if view.prefill_steps > 1:
        return smallest is not None and (view.step_s or 0.0) <= cfg.join_slowdown * smallest
    if smallest is None:
        return view.in_group
    step = view.decode_s if view.decode_s is not None else view.step_s
    if step is None:
        return True
    return step <= cfg.join_slowdown * smallest


def place_for_one(view: BatchView, cfg: StepConfig) -> Literal["free", "preempt", "full"]:
    """Whether an interactive job that joins has a place: ``free`` under the cap;
    ``preempt`` at the cap, where the batch job that joined last gives its place up (the
    least work lost) while the batch's own jobs keep ``own_floor`` of the slots (at least
    one); ``full`` when they are down to that."""
    if view.size < view.cap:
        return "free"
    if view.own <= max(1, int(view.cap * cfg.own_floor)):
        return "full"
    return "preempt"


@dataclass(frozen=True)
class Waiting:
    """What the rules read of a job taken from a queue ahead of the batch's."""

    joinable: bool  # its batch key is the batch's, and no prefix is prefilling to keep
    fits_beside: bool  # its KV caches, alone, fit beside what the batch reserves
    side_lane: bool  # it can be batched in the side lane (its key's, or none open; no group)
    sequences: int = 1  # n > 1 choices: n sequences, joining only where n places are free


def side_lane_free(open_lanes: Collection[Hashable], key: Hashable, cfg: StepConfig) -> bool:
    """Whether a job of batch ``key`` has a side lane: its key's is open (among
    ``open_lanes``), or fewer than ``side_lanes`` are; ``key`` None: a job that cannot be
    batched, which needs a (solo) lane of its own."""
    return (key is not None and key in open_lanes) or len(open_lanes) < cfg.side_lanes


def side_turn(turn: int, keyed: int, solos: int) -> int:
    """Which side lane steps at side step ``turn``: the ``keyed`` lanes in the order they
    opened and, after them, the oldest of the ``solos`` lanes (index ``keyed``), in turn.
    Solo lanes are first come, first served: taking turns, each would end later (12
    seeded requests beside a batch: p50 3.3 s against 2.5 s)."""
    return turn % (keyed + min(solos, 1))


#: Where a waiting job runs: ``join`` the batch (``preempt``: after the batch job that
#: joined last gives its place up), the ``side`` lane, ``alone`` between two steps, or
#: ``wait`` (back to the front of its queue, until a job joins or leaves a lane).
Where = Literal["join", "preempt", "side", "alone", "wait"]


def where(view: BatchView, job: Waiting, cfg: StepConfig) -> Where:
    """Where a job waiting ahead runs. It joins when joining pays (:func:`joins`) and
    there is a place (:func:`place_for_one`); else beside the batch, in the side lane
    when it can be batched, alone otherwise, when its caches fit beside the batch's; when
    they do not, it joins even where joining does not pay (slower than beside, sooner
    than waiting) if there is a place, and waits for the batch to end if there is none.
    A job of several sequences (n choices) joins only where that many places are free."""
    place = place_for_one(view, cfg) if job.joinable else "full"
    if job.sequences > 1 and view.size + job.sequences > view.limit:
        place = "full"  # (no preempting for several places: it runs beside, or waits)
    can_join = place != "full"
    if can_join and joins(view, cfg):
        return "join" if place == "free" else "preempt"
    if job.fits_beside:
        return "side" if job.side_lane else "alone"
    if can_join:
        return "join" if place == "free" else "preempt"
    return "wait"


#: Which lane steps in a turn of the worker's loop: the batch's or the side lane.
Stepped = Literal["batch", "side"]


@dataclass(frozen=True)
class Plan:
    """One turn of the worker's loop, as :func:`plan` decides it."""

    step: Stepped | None  # the lane that steps (None: neither holds a job)
    budget: int | None  # prompt tokens the batch's step may prefill (None: whole chunks)
    look: bool  # look at the queues ahead (a job there goes where :func:`where` says)


def plan(view: BatchView, cfg: StepConfig) -> Plan:
    """The turn: the side lane (jobs from queues ahead, a higher priority class) steps
    while the batch is owed nothing, else the batch's lane (its floor:
    :func:`owed_after_beside`); with the batch's lane empty the side lane steps freely.
    The queues ahead are looked at while the batch is owed nothing (jobs taken there run
    beside it) and the last look is old enough; the batch's prefill budget is
    :func:`prefill_budget`."""
    side = view.beside > 0 and (view.owed <= 0 or view.size == 0)
    step: Stepped | None = "side" if side else ("batch" if view.size else None)
    budget = prefill_budget(view, cfg) if view.budgeted else None
    return Plan(step, budget, view.ahead and view.look_due and view.owed <= 0)


def preempted(own: Sequence[bool]) -> int:
    """Which row gives its place up when ``where`` says ``preempt``, given for each row in
    the order they joined whether it is the batch's own (its queue's, not streamed): the
    own job that joined last, the least work lost (``place_for_one`` keeps at least one of
    them)."""
    return max(i for i, mine in enumerate(own) if mine)


def kept_rows(view: BatchView, cfg: StepConfig) -> int:
    """The batch's own rows that stay when memory is made for a job from a queue ahead:
    ``own_floor`` of the rows it takes now (at least one), as at the cap."""
    return max(1, int(min(view.cap, view.limit) * cfg.own_floor))


def leavers(own: Sequence[bool], keep: int) -> list[int]:
    """The rows that may give their memory up, in the order they would: given for each
    row in the order they joined whether it is the batch's own (its queue's, not
    streamed), the own ones joined last first; the first ``keep`` own ones stay."""
    return [i for i, mine in enumerate(own) if mine][keep:][::-1]


def preempt_for_room(short: int, freed: Sequence[int]) -> int | None:
    """How many of the batch's own rows (joined last first) give their places up so that a
    job from a queue ahead fits in memory (vLLM preempts by priority under memory as well):
    0 when it fits (``short`` <= 0 bytes missing), else the fewest whose leaving frees
    ``short`` (``freed[i]``: what the last ``i + 1`` leaving frees, down to
    :func:`kept_rows`); None when even those do not: it waits. A preempted row goes back
    to the front of its queue unstarted (its text, greedy, is the same when it runs)."""
    if short <= 0:
        return 0
    return next((i + 1 for i, f in enumerate(freed) if f >= short), None)


def prefill_budget(view: BatchView, cfg: StepConfig) -> int | None:
    """The token budget: prompt tokens the batch's next step may prefill (None: whole
    chunks), what its engine prefills in ``prefill_budget_s`` at the speed it measured
    while an interactive job is in the batch or beside it, or was seen waiting within
    ``quiet_s``, else in ``quiet_budget_s``; before any speed is measured, 0 (the
    engine's least chunk per sequence)."""
    if cfg.prefill_budget_s is None:
        return None
    waits = view.own < view.size or view.beside > 0 or view.since_ahead_s < cfg.quiet_s
    seconds = cfg.prefill_budget_s if waits else cfg.quiet_budget_s
    return int(seconds * (view.prefill_rate or 0.0))


def owed_after_beside(owed: float, took: float, cfg: StepConfig) -> float:
    """The step seconds the batch is owed after work beside it (a side-lane step, a job
    alone) took ``took`` seconds: the batch keeps ``batch_floor`` of the time. The next
    may run at once while nothing is owed (the result <= 0)."""
    return owed + took * cfg.batch_floor / (1 - cfg.batch_floor)


def owed_after_step(owed: float, seconds: float, cfg: StepConfig) -> float:
    """What the batch is owed after its own step of ``seconds`` (at most
    ``floor_credit_s`` ahead of its floor)."""
    return max(owed - seconds, -cfg.floor_credit_s)


def model_waits(queues: Sequence[str], model_wait_s: float) -> list[int]:
    """Per queue, the milliseconds a job for a model not loaded here may be passed over
    for one of a loaded model (``schemas/lua/affine.lua``): ``--model-wait``, except on
    the interactive queue, taken in order (a person waits on each request)."""
    wait_ms = max(0, int(model_wait_s * 1000))
    return [0 if q == keys.INTERACTIVE_QUEUE else wait_ms for q in queues]
