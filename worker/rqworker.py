"""The RQ worker: no fork, JSON only, and only mlxq's own job function.

RQ's default Worker forks a work horse per job (the model would reload every
job, and forking after Metal is initialised crashes on macOS), and by default
imports and runs any dotted path stored in a job hash. ``MlxqWorker`` runs jobs
in-process, and ``SafeJob`` refuses anything but :data:`schemas.keys.JOB_FUNCTION`,
ignores callbacks and webhooks named in job hashes, and never unpickles.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rq import SimpleWorker
from rq.job import Job
from rq.serializers import JSONSerializer

from schemas import InvalidRequestError, keys


class UnsafeJobError(InvalidRequestError):
    """A job hash names something other than mlxq's job function."""

    code = "unsafe_job"


def _job_function() -> Callable[..., Any]:
    from worker.jobs import run_chat_job

    return run_chat_job


class SafeJob(Job):
    """An RQ job that can only ever call mlxq's job function."""

    def __init__(
        self, id: str | None = None, connection: Any = None, serializer: Any = None
    ) -> None:
        super().__init__(id=id, connection=connection, serializer=JSONSerializer)

    @property
    def func(self) -> Callable[..., Any]:
        name = self.func_name
        if name != keys.JOB_FUNCTION or self.instance is not None:
            raise UnsafeJobError(
                f"job {self.id} names function {name!r}; this worker runs only {keys.JOB_FUNCTION}"
            )
        return _job_function()

    # Callbacks and webhooks named in job data are never honoured.
    @property
    def success_callback(self) -> None:
        return None

    @property
    def failure_callback(self) -> None:
        return None

    @property
    def stopped_callback(self) -> None:
        return None

    def send_webhooks(self, status: Any, *, exc_string: str | None = None) -> None:
        return None


class MlxqWorker(SimpleWorker):
    """A non-forking worker: models stay loaded in this process across jobs."""

    job_class = SafeJob

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs["serializer"] = JSONSerializer
        kwargs.setdefault("job_class", SafeJob)
        super().__init__(*args, **kwargs)
