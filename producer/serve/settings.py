"""The gateway's settings, its API keys, and OpenAI-shaped error responses."""

from __future__ import annotations

import fnmatch
import hmac
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from fastapi.responses import JSONResponse

from producer.tenants import check_weight
from schemas import keys
from schemas.settings import DEFAULT_REDIS_URL

ENV_API_KEYS = "MLXQ_API_KEYS"
#: The tenant field of an operator's key (``KEY *``, ``KEY=*``): it reads every tenant's
#: batches and files (``/ui`` shows the whole fleet); what it sends is the default tenant's.
OPERATOR = "*"
#: How ``producer serve --workers N`` hands its settings to the processes uvicorn starts.
ENV_CONFIG = "MLXQ_GATEWAY_CONFIG"
MB = 1 << 20


@dataclass(frozen=True)
class GatewaySettings:
    redis_url: str = DEFAULT_REDIS_URL
    api_keys: frozenset[str] = field(default_factory=frozenset)
    #: False only with ``--no-auth`` (a gateway on 127.0.0.1 for one user).
    auth: bool = True
    allow_models: tuple[str, ...] = ()
    #: Where the jobs of Batch API batches go.
    queue: str = keys.DEFAULT_QUEUE
    #: Where chat completions go (workers serve it first by default).
    interactive_queue: str = keys.INTERACTIVE_QUEUE
    #: A chat completion is refused with 429 while the interactive queue is this deep.
    max_interactive: int = 256
    max_file_bytes: int = 200 * MB
    max_body_bytes: int = 8 * MB
    file_ttl: int = keys.DEFAULT_RESULT_TTL
    result_ttl: int = keys.DEFAULT_RESULT_TTL
    #: Result TTL of a chat completion's record (the client has it once answered).
    chat_ttl: int = 3600
    #: Longest a chat completion waits for its record (504 after, and cancelled if unstarted).
    chat_timeout_s: float = 600.0
    job_timeout: int = 3600
    #: WAIT for this many replicas after each enqueue (``--wait-replicas``).
    wait_replicas: int = 0
    #: (key, tenant) of keys that name a tenant: their Batch API batches are that
    #: tenant's (fair share, usage); other keys' are the default tenant's.
    key_tenants: tuple[tuple[str, str], ...] = ()
    #: Keys that read every tenant's batches and files (:data:`OPERATOR`).
    operator_keys: frozenset[str] = field(default_factory=frozenset)

    def to_env(self) -> str:
        data = asdict(self) | {
            "api_keys": sorted(self.api_keys),
            "operator_keys": sorted(self.operator_keys),
        }
        return json.dumps(data)

    @classmethod
    def from_env(cls) -> GatewaySettings:
        data = json.loads(os.environ[ENV_CONFIG])
        data["api_keys"] = frozenset(data["api_keys"])
        data["operator_keys"] = frozenset(data["operator_keys"])
        data["allow_models"] = tuple(data["allow_models"])
        data["key_tenants"] = tuple(tuple(kt) for kt in data["key_tenants"])
        return cls(**data)

    def tenant_of(self, header: str | None) -> str:
        """The tenant of the key an ``Authorization`` header carries (default if none)."""
        if not header or not header.startswith("Bearer "):
            return keys.DEFAULT_TENANT
        given = header[len("Bearer ") :].strip().encode()
        found = keys.DEFAULT_TENANT
        for key, tenant in self.key_tenants:  # every key compared: constant time
            if hmac.compare_digest(given, key.encode()):
                found = tenant
        return found

    def scope_of(self, header: str | None) -> str | None:
        """Whose batches and files the key an ``Authorization`` header carries reads: its
        tenant's, or every tenant's (None) for an operator's key or a gateway without
        keys (``--no-auth``)."""
        if not self.auth:
            return None
        bearer = header is not None and header.startswith("Bearer ")
        given = header[len("Bearer ") :].strip().encode() if bearer else b""
        operator = False
        for key in self.operator_keys:  # every key compared: constant time
            operator |= hmac.compare_digest(given, key.encode())
        return None if operator else self.tenant_of(header)

    def key_ok(self, header: str | None) -> bool:
        """Whether an ``Authorization`` header carries one of the API keys."""
        if not self.auth:
            return True
        if not header or not header.startswith("Bearer "):
            return False
        given = header[len("Bearer ") :].strip().encode()
        # compare_digest against every key: the time does not depend on which matched.
        return any([hmac.compare_digest(given, k.encode()) for k in self.api_keys])

    def model_allowed(self, name: str) -> bool:
        return not self.allow_models or any(fnmatch.fnmatchcase(name, p) for p in self.allow_models)


def load_api_keys(path: Path | None, env: str | None) -> frozenset[str]:
    """Keys from a file (one per line, ``#`` comments) and from ``MLXQ_API_KEYS``
    (comma- or space-separated); a key may name its tenant (see :func:`load_key_tenants`)."""
    return frozenset(key for key, _, _ in _entries(path, env))


def load_key_tenants(path: Path | None, env: str | None) -> tuple[tuple[str, str], ...]:
    """(key, tenant) of the keys that name one: ``KEY TENANT [WEIGHT]`` on a line of the
    file, ``KEY=TENANT[:WEIGHT]`` in ``MLXQ_API_KEYS``. Raises ValueError naming a bad
    tenant or weight (never the key)."""
    entries = _entries(path, env)
    return tuple(sorted((k, t) for k, t, _ in entries if t is not None and t != OPERATOR))


def load_operator_keys(path: Path | None, env: str | None) -> frozenset[str]:
    """The operators' keys: ``KEY *`` on a line of the file, ``KEY=*`` in
    ``MLXQ_API_KEYS`` (see :data:`OPERATOR`)."""
    return frozenset(k for k, t, _ in _entries(path, env) if t == OPERATOR)


def load_tenant_weights(path: Path | None, env: str | None) -> dict[str, float]:
    """The fair-share weight each key names for its tenant (``KEY TENANT WEIGHT``): the
    gateway sets them at start. Two keys giving one tenant different weights: ValueError
    naming the tenant."""
    weights: dict[str, float] = {}
    for _, tenant, weight in _entries(path, env):
        if tenant is None or weight is None:
            continue
        if weights.setdefault(tenant, weight) != weight:
            raise ValueError(
                f"tenant {tenant!r} is given two weights ({weights[tenant]:g} and {weight:g})"
            )
    return weights


Entry = tuple[str, str | None, float | None]  # (key, tenant, weight)


def _entries(path: Path | None, env: str | None) -> list[Entry]:
    raw: list[tuple[str, list[str], str]] = []  # (key, [tenant, weight] given, where)
    if path is not None:
        for n, line in enumerate(path.read_text().splitlines(), start=1):
            parts = line.split("#", 1)[0].split()
            if len(parts) > 3:
                raise ValueError(f"{path}:{n}: expected KEY, KEY TENANT or KEY TENANT WEIGHT")
            if parts:
                raw.append((parts[0], parts[1:], f"{path}:{n}"))
    for i, part in enumerate((env or "").replace(",", " ").split(), start=1):
        key, sep, rest = part.partition("=")
        tenant, colon, weight = rest.partition(":")
        given = [tenant, weight] if colon else [tenant] if sep else []
        raw.append((key, given, f"{ENV_API_KEYS} entry {i}"))
    out: list[Entry] = []
    for key, given, where in raw:
        if not key:
            raise ValueError(f"{where}: an API key is empty")
        tenant = None
        if given:
            tenant = OPERATOR if given[0] == OPERATOR else keys.validate_tenant(given[0])
        weight = None
        if len(given) == 2 and tenant == OPERATOR:
            raise ValueError(f"{where}: an operator's key ({OPERATOR}) takes no weight")
        if len(given) == 2:
            try:
                weight = check_weight(float(given[1]))
            except ValueError as e:
                raise ValueError(f"{where}: tenant {tenant!r}: {e}") from None
        out.append((key, tenant, weight))
    return out


def error(
    status: int, message: str, type_: str = "invalid_request_error", code: str | None = None
) -> JSONResponse:
    """An OpenAI error response: ``{"error": {"message", "type", "param", "code"}}``."""
    body = {"error": {"message": message, "type": type_, "param": None, "code": code}}
    return JSONResponse(body, status_code=status)
