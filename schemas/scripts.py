"""Lua scripts: one ``.lua`` file each under ``schemas/lua/``, loaded by name.

Every state change that must be atomic in Redis is one script: the producer's
enqueue and cancel sweep, the worker's lifecycle (take, end, requeue, renew,
recover, prune, unregister) and the write-once result every record writer runs.
Each file starts with the keys and arguments it touches. A line
``--! include NAME`` is replaced by the file ``NAME.lua`` (shared fragments:
``now_ms``, ``drop``, ``write_once_body``, ``fair``, ``affine``), and ``{{NAME}}`` by a constant of
:data:`CONSTANTS`, so a script is one self-contained source as Redis sees it.
"""

from __future__ import annotations

import functools
import re
from importlib.resources import files

from schemas import keys

_INCLUDE = re.compile(r"^--! include (\w+)\n", re.M)

#: Constants scripts name as ``{{NAME}}`` (Lua literals).
CONSTANTS = {
    "NOTIFY_PREFIX": f"'{keys.NOTIFY_PREFIX}'",
    "NOTIFY_TTL": str(keys.NOTIFY_TTL),
    "ERRORS_KEPT": str(keys.BATCH_ERRORS_KEPT),
    "FAIR_PREFIX": f"'{keys.FAIR_PREFIX}'",
    "FAIR_SCAN": "64",  # lists found empty per take, at most (each leaves the set)
    "AFFINE_SCAN": "64",  # jobs of a list a take looks at for a loaded model, at most
    "RING_PREFIX": f"'{keys.RING_PREFIX}'",
    "WAKE_PREFIX": f"'{keys.WAKE_PREFIX}'",
    "WAKE_MAX": "64",  # idle workers one push wakes, at most
    "WAKE_TTL": "30",
    "QUEUE_PREFIX": f"'{keys.rq_queue_key('')}'",
    "TENANTS": f"'{keys.TENANTS}'",
    "DEFAULT_TENANT": f"'{keys.DEFAULT_TENANT}'",
    "USAGE_TTL": str(keys.USAGE_TTL),
    "LIMITS": f"'{keys.TENANT_LIMITS}'",
    "RUNNING": f"'{keys.RUNNING}'",
    "WEBHOOK_URLS": f"'{keys.TENANT_WEBHOOKS}'",
    "WEBHOOKS": f"'{keys.WEBHOOKS}'",
}


@functools.cache
def source(name: str) -> str:
    """The Lua source of script ``name`` with its includes and constants filled in."""
    text = files("schemas").joinpath("lua", f"{name}.lua").read_text()
    text = _INCLUDE.sub(lambda m: source(m.group(1)), text)
    for constant, value in CONSTANTS.items():
        text = text.replace("{{" + constant + "}}", value)
    if "{{" in text:
        raise ValueError(f"Lua script {name!r} names an unknown constant")
    return text
