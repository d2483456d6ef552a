"""The worker's runtime: what the CLI built (model cache, policy, limits), passed down."""

from __future__ import annotations

import fnmatch
import os
import socket
from dataclasses import dataclass, field
from pathlib import Path

from schemas import ChatRequest, InvalidRequestError, ModelNotAllowedError
from schemas.audio import MAX_AUDIO_S
from worker.engine.drafters import MTP
from worker.engine.models import ModelCache, local_dir
from worker.runner.access import ModelAccess
from worker.runner.company import Scout
from worker.runner.imagehosts import ImageHosts
from worker.runner.stats import WorkerStats
from worker.schedule.policy import SpeculationPolicy
from worker.schedule.step import StepConfig


@dataclass
class WorkerRuntime:
    """What a job needs from the worker that runs it."""

    cache: ModelCache = field(default_factory=ModelCache)
    worker_id: str = field(default_factory=lambda: f"{socket.gethostname()}.{os.getpid()}")
    allow_models: tuple[str, ...] = ()  # without ``access``: globs over names as written
    # Model directories, globs and --model names (the worker command's rules), if any.
    access: ModelAccess | None = None
    default_num_draft_tokens: int = 3
    stats: WorkerStats = field(default_factory=WorkerStats)
    policy: SpeculationPolicy = field(default_factory=SpeculationPolicy)
    max_n: int = 16  # the most choices (``n``) one job may ask for here (``--max-n``)
    scout: Scout = field(default_factory=Scout)  # when a job looks at its queue's next jobs
    # Share the policy's figures with the fleet in Redis (``worker.runner.figures``), as
    # this kind of machine (None: found from the chip, memory and device).
    share_figures: bool = False
    machine_kind: str | None = None
    # The hosts jobs' image URLs are fetched from (``--allow-image-host``; none: no URLs).
    image_hosts: ImageHosts = field(default_factory=ImageHosts)
    # The rules between a batch's steps and their constants (``worker.schedule.step``);
    # ``--interactive-join`` sets its ``join_mode``.
    step: StepConfig = field(default_factory=StepConfig)
    # The most seconds a job may run here once taken (``--time-limit``; None: no limit of
    # the worker's own; a batch's job timeout and a request's ``time_limit_s`` still hold).
    time_limit_s: float | None = None
    # The longest recording an audio job may carry (``--max-audio-seconds``).
    max_audio_s: float = MAX_AUDIO_S
    # The thinking budget of a request that sets none (``--thinking-budget``; None: no cap).
    thinking_budget: int | None = None

    def find_local(self, name: str) -> Path | None:
        """Where ``name`` is on this machine already (None: not fetched yet); raises
        :class:`ModelNotAllowedError` for a name this worker does not serve."""
        if self.access is not None:
            return self.access.local(name)
        return local_dir(name)

    def check_allowed(self, name: str, what: str = "model") -> None:
        """Raise :class:`ModelNotAllowedError` unless ``name`` may be served here
        (:class:`ModelAccess`, else an ``allow_models`` glob matches it)."""
        if self.access is not None:
            self.access.where(name, what)
            return
        if self.allow_models and not any(fnmatch.fnmatchcase(name, p) for p in self.allow_models):
            raise ModelNotAllowedError(
                f"{what} {name!r} is not allowed on this worker (allowed: "
                f"{', '.join(self.allow_models)})"
            )

    def with_defaults(self, request: ChatRequest) -> ChatRequest:
        """``request`` with this worker's defaults where it sets none (a thinking budget)."""
        if self.thinking_budget is None or request.thinking_limit is not None:
            return request
        return request.model_copy(update={"thinking_budget": self.thinking_budget})

    def check_request(self, request: ChatRequest) -> None:
        """:meth:`check_allowed` for every model a request names (model, draft, adapter)."""
        self.check_allowed(request.model)
        if request.draft_model and request.draft_model != MTP:  # (the model's own heads)
            self.check_allowed(request.draft_model, "draft model")
        if request.adapter:
            self.check_allowed(request.adapter, "adapter")
        if request.n > self.max_n:
            raise InvalidRequestError(
                f"n={request.n} is more choices than this worker runs in one job "
                f"(--max-n {self.max_n}): submit several jobs with different seeds"
            )
