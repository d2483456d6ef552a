"""The name every mlxq job hash gives its function (``schemas.keys.JOB_FUNCTION``).

mlxq jobs run in mlxq's own ``worker``, which reads job hashes itself and never
calls this; it exists so that an RQ worker handed an mlxq job fails it clearly.
The dotted path is part of the job format, so it stays here whatever the worker's
layout.
"""

from __future__ import annotations

from typing import Any


def run_chat_job(payload: dict[str, Any]) -> None:
    """Refuse to run: mlxq jobs run only in mlxq's ``worker``."""
    raise RuntimeError("mlxq jobs run only in mlxq's `worker`, not in an RQ worker")
