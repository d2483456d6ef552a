"""The step rules of a running batch, pure (no Redis, no MLX), with every constant in one place.

Between two steps of a batch the runner (``worker.runner.continuous``) asks:

- :func:`where`: where does a job waiting ahead (``mlxq.interactive``) run: joining
  the batch, in the side lane, alone between two steps, or after the batch? It reads
  :func:`joins` (join, or run beside?) and :func:`place_for_one` (a place, or does a
  batch job give one up?).
- :func:`prefill_budget`: how many seconds of prompt may the next step prefill?
- :func:`owed_after_alone` / :func:`owed_after_step`: the time share of jobs run beside
  the batch (they take at most ``urgent_share`` of the time; the batch banks a little
  credit while none wait).

and before each take, :func:`model_waits`: how long a queue's job for a model not loaded
may be passed over for one of a loaded model (the take script applies it).

Each reads a :class:`BatchView` (what the runner measured and holds) and a
:class:`StepConfig` (the constants, frozen; ``WorkerRuntime.step``), and returns a
decision the runner applies. Tests construct views and check decisions in milliseconds.
"""

from __future__ import annotations

from collections.abc import Sequence
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
    #: The most of the wall time jobs run beside the batch may take.
    urgent_share: float = 0.75
    #: The most step seconds a batch banks for them while none wait.
    urgent_bank_s: float = 2.0
    #: Seconds of prompt prefill a step takes at most while someone may wait on it.
    prefill_budget_s: float | None = 0.5
    #: Seconds after an interactive job was last seen waiting that the budget holds
    #: (requests come in streams).
    quiet_s: float = 5.0
    #: Seconds of prompt prefill a plain batch's step takes at most while nobody waits
    #: (larger chunks; a request arriving meanwhile waits at most that step).
    quiet_budget_s: float = 4.0

    def __post_init__(self) -> None:
        if self.join_mode not in JOIN_MODES:
            raise ValueError(f"join mode must be one of {JOIN_MODES}, not {self.join_mode!r}")


@dataclass(frozen=True)
class BatchView:
    """What the step rules read of one running batch."""

    size: int = 0  # rows held
    cap: int = 256  # the most rows it may hold (``--max-batch N``, or the auto cap)
    own: int = 0  # rows from the batch's own queue (the others came from queues ahead)
    step_s: float | None = None  # its steps' seconds, prefills too (running average)
    decode_s: float | None = None  # its steps' seconds that only decoded (running)
    smallest_step_s: float | None = None  # a step at the smallest size measured (<= small)
    prefill_steps: int = 0  # steps still to carry prompt chunks of its rows, about
    in_group: bool = False  # a worker group's (its ranks step alike; no side batch)
    beside: int = 0  # rows of the side batch beside it
    since_ahead_s: float = float("inf")  # since a job was last seen waiting ahead


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


#: Where a waiting job runs: ``join`` the batch (``preempt``: after the batch job that
#: joined last gives its place up), the ``side`` lane, ``alone`` between two steps, or
#: ``wait`` (back to the front of its queue, until the batch ends).
Where = Literal["join", "preempt", "side", "alone", "wait"]


def where(view: BatchView, job: Waiting, cfg: StepConfig) -> Where:
    """Where a job waiting ahead runs. It joins when joining pays (:func:`joins`) and
    there is a place (:func:`place_for_one`); else beside the batch, in the side lane
    when it can be batched, alone otherwise, when its caches fit beside the batch's; when
    they do not, it joins even where joining does not pay (slower than beside, sooner
    than waiting) if there is a place, and waits for the batch to end if there is none."""
    place = place_for_one(view, cfg) if job.joinable else "full"
    can_join = place != "full"
    if can_join and joins(view, cfg):
        return "join" if place == "free" else "preempt"
    if job.fits_beside:
        return "side" if job.side_lane else "alone"
    if can_join:
        return "join" if place == "free" else "preempt"
    return "wait"


def preempted(queues: Sequence[str], own: str) -> int:
    """Which row gives its place up when ``where`` says ``preempt``, given each row's queue
    in the order they joined: the batch's own (``own`` queue) job that joined last, the
    least work lost (``place_for_one`` keeps at least one of them)."""
    return max(i for i, q in enumerate(queues) if q == own)


def prefill_budget(view: BatchView, cfg: StepConfig) -> float | None:
    """Seconds of prompt the next step of a plain batch may prefill (None: whole chunks):
    ``prefill_budget_s`` while an interactive job is in the batch or beside it, or was
    seen waiting within ``quiet_s``; else ``quiet_budget_s``."""
    if cfg.prefill_budget_s is None:
        return None
    waits = view.own < view.size or view.beside > 0 or view.since_ahead_s < cfg.quiet_s
    return cfg.prefill_budget_s if waits else cfg.quiet_budget_s


def owed_after_alone(owed: float, took: float, cfg: StepConfig) -> float:
    """The step seconds the batch is owed after a job ran beside it for ``took`` seconds
    (such jobs take at most ``urgent_share`` of the time). The next may run at once while
    nothing is owed (the result <= 0)."""
    return owed + took * (1 - cfg.urgent_share) / cfg.urgent_share


def owed_after_step(owed: float, seconds: float, cfg: StepConfig) -> float:
    """What the batch is owed after its own step of ``seconds`` (it banks at most
    ``urgent_bank_s`` of credit while none wait)."""
    return max(owed - seconds, -cfg.urgent_bank_s)


def model_waits(queues: Sequence[str], model_wait_s: float) -> list[int]:
    """Per queue, the milliseconds a job for a model not loaded here may be passed over
    for one of a loaded model (``schemas/lua/affine.lua``): ``--model-wait``, except on
    the interactive queue, taken in order (a person waits on each request)."""
    wait_ms = max(0, int(model_wait_s * 1000))
    return [0 if q == keys.INTERACTIVE_QUEUE else wait_ms for q in queues]
