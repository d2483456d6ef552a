"""The job envelope, and reading an mlxq job back from its RQ job hash without trusting it.

A producer stores each job as an RQ job hash whose ``data`` field is RQ's
zlib-compressed, JSON-serialised call ``[function, instance, args, kwargs]``
with :data:`schemas.keys.JOB_FUNCTION` as the function and the envelope as its
only argument (:func:`job_data` makes it). The stored envelope leaves out what the
job's key already says (``job_id``, ``batch_id``) and a default ``result_ttl``:
a million queued jobs are a million copies of each byte. Anyone who can write
to Redis can write such a hash, so :func:`read_job_hash` checks it field by
field before anything else reads it: JSON only (pickled bytes are never
unpickled), mlxq's function only, no callbacks or webhooks, an envelope that
validates and names this very job.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from schemas.embeddings import JobRequest
from schemas.keys import DEFAULT_RESULT_TTL, JOB_FUNCTION, batch_of
from schemas.validation import describe_validation_error


class JobEnvelope(BaseModel):
    """One job: ids, timing and the validated request (chat, or embeddings: told apart by
    the request's ``input``). The RQ job's only argument."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    job_id: str = Field(min_length=1)
    batch_id: str = Field(min_length=1)
    custom_id: str = Field(min_length=1)
    submitted_at: float
    result_ttl: int = Field(default=DEFAULT_RESULT_TTL, ge=1)
    request: JobRequest


#: RQ job-hash fields that ask a worker to run more code. mlxq honours none of them,
#: so a hash that sets one is refused rather than silently run without it.
CALLBACK_FIELDS = (
    b"success_callback_name",
    b"failure_callback_name",
    b"stopped_callback_name",
    b"webhooks",
)


def job_data(
    custom_id: str, submitted_at: float, request: Mapping[str, Any], result_ttl: int
) -> bytes:
    """The ``data`` field of a job hash: RQ's zlib-compressed JSON call, envelope as its
    argument, without the fields the key implies (:func:`read_job_hash` fills them in)."""
    envelope: dict[str, Any] = {"custom_id": custom_id, "submitted_at": submitted_at}
    if result_ttl != DEFAULT_RESULT_TTL:
        envelope["result_ttl"] = result_ttl
    envelope["request"] = request
    call = [JOB_FUNCTION, None, [envelope], {}]
    raw = json.dumps(call, separators=(",", ":")).encode()
    if len(raw) < HUFFMAN_BYTES:
        return zlib.compress(raw)
    deflate = zlib.compressobj(1, zlib.DEFLATED, 15, 8, zlib.Z_HUFFMAN_ONLY)
    return deflate.compress(raw) + deflate.flush()


#: From this size on (a job carrying an image) its data is compressed by Huffman coding
#: alone: an image's base64 has little to match, and zlib's default took 34 ms per 1.2 MB
#: job, Huffman alone 7 ms and 0.6% smaller (bench.vision). The same zlib stream to read.
HUFFMAN_BYTES = 64 * 1024


#: A succeeded job's ``data`` once its record is written: RQ's call with no arguments.
#: The request is not needed any more (the record holds the answer), and RQ's tools
#: still read the hash (``Job.fetch``, rq-dashboard).
ENDED_JOB_DATA = zlib.compress(json.dumps([JOB_FUNCTION, None, [], {}]).encode())


class JobRefused(Exception):
    """A job hash that is not a runnable mlxq job.

    ``kind`` says what to do with it: ``missing`` (no hash at all), ``corrupt``
    (not RQ's JSON format), ``unsafe`` (another function, callbacks, webhooks)
    and ``invalid`` (mlxq's function, but the envelope does not validate).
    ``payload`` is the envelope as a plain dict when it could be read as JSON,
    so a failed record can still name the job's batch and custom_id.
    """

    def __init__(self, kind: str, reason: str, payload: dict[str, Any] | None = None) -> None:
        super().__init__(reason)
        self.kind, self.reason, self.payload = kind, reason, payload


@dataclass(frozen=True)
class StoredJob:
    """An mlxq job read from its hash: the envelope and the job's timeout in seconds."""

    envelope: JobEnvelope
    timeout_s: int | None


def read_job_hash(job_id: str, fields: Mapping[bytes, bytes]) -> StoredJob:
    """The job stored in ``fields`` (an RQ job hash), or :class:`JobRefused` saying why not."""
    if not fields:
        raise JobRefused("missing", "no job hash")
    func, instance, args, kwargs = _call(fields.get(b"data"))
    if func != JOB_FUNCTION or instance is not None:
        raise JobRefused(
            "unsafe", f"job names function {func!r}; this worker runs only {JOB_FUNCTION}"
        )
    payload = args[0] if isinstance(args, list) and len(args) == 1 else None
    payload = payload if isinstance(payload, dict) else None
    named = [f.decode() for f in CALLBACK_FIELDS if fields.get(f)]
    if payload is not None:
        # What the key implies; an envelope that names another job is refused below.
        payload = {"job_id": job_id, "batch_id": batch_of(job_id)} | payload
    if named:
        raise JobRefused(
            "unsafe", f"job names {', '.join(named)}: callbacks are never honoured", payload
        )
    if payload is None or kwargs != {}:
        raise JobRefused("invalid", "invalid job payload: the call's arguments are not [envelope]")
    try:
        envelope = JobEnvelope.model_validate(payload)
    except ValidationError as e:
        raise JobRefused(
            "invalid", f"invalid job payload: {describe_validation_error(e)}", payload
        ) from None
    if envelope.job_id != job_id:
        raise JobRefused(
            "unsafe", f"job hash {job_id!r} carries the envelope of job {envelope.job_id!r}"
        )
    return StoredJob(envelope, _timeout(fields.get(b"timeout")))


def _call(data: bytes | None) -> tuple[Any, Any, Any, Any]:
    """RQ's ``[function, instance, args, kwargs]`` from the ``data`` field, as JSON only."""
    if not data:
        raise JobRefused("corrupt", "job hash has no data field")
    try:
        raw = zlib.decompress(data)
    except zlib.error:
        raw = data  # RQ stores uncompressed data too
    try:
        call = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        raise JobRefused("corrupt", "job data is not JSON (pickled? never unpickled)") from None
    if not isinstance(call, list) or len(call) != 4:
        raise JobRefused("corrupt", "job data is not RQ's [function, instance, args, kwargs]")
    return call[0], call[1], call[2], call[3]


def _timeout(raw: bytes | None) -> int | None:
    try:
        value = int(raw) if raw else None
    except ValueError:
        return None
    return value if value is None or value > 0 else None
