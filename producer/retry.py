"""``producer retry``: run a batch's failed jobs again, by the cause they failed with.

One script per page of the batch's jobs (``schemas/lua/retry.lua``) queues the matching
failed jobs again at the back of the queue they came from; each job's old record stays
readable until the new run's end replaces it in the same script that writes it
(``end.lua``), and the batch's counts say the job is not ended meanwhile. A job already
queued again or running is left alone, so a retry sent twice runs nothing twice.
Succeeded and cancelled jobs never rerun; a cancelled batch refuses the retry.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from pydantic import BaseModel, ConfigDict, Field
from redis import Redis

from producer.batches import BatchNotFoundError, batch_job_ids
from producer.submit import BatchCancelledError
from schemas import InvalidRequestError, ResultRecord, keys
from schemas.cancel import CANCELLED_AT
from schemas.scripts import source

_RETRY = source("retry")

_STATUS = re.compile(r"[1-5](?:xx|[0-9]{2})")
_CODE = re.compile(r"[a-z0-9_]{1,64}")


@dataclass(frozen=True)
class RetryFilter:
    """Which failed jobs run again: any of ``status_codes`` (``"503"``, ``"5xx"``) and any
    of ``error_codes`` (the record's ``error.code``); an empty tuple matches every job."""

    status_codes: tuple[str, ...] = ()
    error_codes: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for s in self.status_codes:
            if not _STATUS.fullmatch(s):
                raise InvalidRequestError(
                    f"invalid status code {s!r}: use a code such as 503, or a class such as 5xx"
                )
        for c in self.error_codes:
            if not _CODE.fullmatch(c):
                raise InvalidRequestError(
                    f"invalid error code {c!r}: use an error code as records name it "
                    "(lowercase letters, digits, '_'), e.g. model_load_error"
                )

    def matches(self, record: ResultRecord) -> bool:
        if record.status != "failed":
            return False
        code = str(record.status_code)
        if self.status_codes and not any(
            s == code or (s.endswith("xx") and code[0] == s[0]) for s in self.status_codes
        ):
            return False
        error = record.error.code if record.error is not None else ""
        return not self.error_codes or error in self.error_codes


class RetryBody(BaseModel):
    """The body of the gateway's ``POST /v1/batches/{id}/retry`` (all fields optional)."""

    model_config = ConfigDict(extra="forbid")
    status_codes: list[str] = Field(default_factory=list, max_length=32)
    error_codes: list[str] = Field(default_factory=list, max_length=32)

    def filter(self) -> RetryFilter:
        return RetryFilter(tuple(self.status_codes), tuple(self.error_codes))


@dataclass
class RetryReport:
    """What a retry did: jobs queued again, and the failed jobs it left, by why."""

    batch_id: str
    queued: int = 0
    #: already queued again or running (a retry sent twice, or during a retry's run)
    pending: int = 0
    #: failed jobs the filter did not match
    unmatched: int = 0
    #: ended again between reading and queueing (read again by the next retry)
    changed: int = 0
    #: failed without a kept request (an invalid line refused by the producer)
    unkept: int = 0
    by_code: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict[str, object]:
        return {
            "batch_id": self.batch_id,
            "queued": self.queued,
            "pending": self.pending,
            "unmatched": self.unmatched,
            "changed": self.changed,
            "unkept": self.unkept,
            "by_code": self.by_code,
        }


def retry_batch(conn: Redis, batch_id: str, flt: RetryFilter | None = None) -> RetryReport:
    """Queue the batch's failed jobs that match ``flt`` again. Two round trips per page of
    1,000 jobs (read the records, then one script), whatever the batch's size.

    Raises :class:`BatchNotFoundError` or :class:`BatchCancelledError`."""
    flt = flt or RetryFilter()
    meta = conn.hmget(keys.batch_key(batch_id), "total", CANCELLED_AT)
    if meta[0] is None:
        raise BatchNotFoundError(
            f"no batch {batch_id!r} in this Redis (expired or never submitted)"
        )
    _cancelled(meta[1], batch_id)
    report = RetryReport(batch_id)
    script = conn.register_script(_RETRY)
    for page in batch_job_ids(conn, batch_id):
        raws = conn.mget([keys.result_key(j) for j in page])
        pairs: list[str | bytes] = []
        for job_id, raw in zip(page, raws, strict=True):
            if raw is None:
                continue
            record = ResultRecord.model_validate_json(raw)
            if record.status != "failed":
                continue
            if not flt.matches(record):
                report.unmatched += 1
                continue
            pairs += [job_id, raw]
            code = record.error.code if record.error is not None else str(record.status_code)
            report.by_code[code] = report.by_code.get(code, 0) + 1
        if not pairs:
            continue
        reply = script(
            keys=[keys.batch_key(batch_id), keys.RQ_QUEUES, keys.RUNNING],
            args=[
                *(keys.rq_job_key(""), keys.result_key(""), keys.rq_queue_key("")),
                *(keys.rq_failed_key(""), keys.crashes_key(""), keys.rq_time()),
                *pairs,
            ],
        )
        if reply[0] == b"cancelled":
            _cancelled(b"1", batch_id)
        queued, pending, changed, unkept = (int(x) for x in reply)
        report.queued += queued
        report.pending += pending
        report.changed += changed
        report.unkept += unkept
    return report


def _cancelled(flag: bytes | None, batch_id: str) -> None:
    if flag is not None:
        raise BatchCancelledError(
            f"batch {batch_id!r} was cancelled: its jobs do not run again "
            "(submit its lines as a new batch)"
        )
