"""Reading and writing result records: the write-once protocol every writer follows."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from schemas import keys
from schemas.result import ResultRecord
from schemas.scripts import source

if TYPE_CHECKING:
    from redis import Redis

#: Lua (``schemas/lua/write_once.lua``): write the record only if none exists (first
#: write wins), count it on its batch and announce it (the batch's done list, and the
#: gateway's notify list if the batch names one). The worker's end-of-job script
#: (``end.lua``) starts with the same body.
_WRITE_ONCE = source("write_once")


def write_once_call(record: ResultRecord, ttl: int) -> tuple[list[str], list[object]]:
    """The write-once script's keys and arguments for ``record``."""
    batch = record.batch_id
    at = repr(record.finished_at)
    return (
        [keys.result_key(record.job_id), keys.batch_key(batch), keys.batch_done_key(batch)],
        [record.model_dump_json(), int(ttl), record.status, record.job_id, at],
    )


def write_result(conn: Redis, record: ResultRecord, ttl: int) -> bool:
    """Store ``record`` unless the job already has one. True if this call wrote it."""
    script_keys, args = write_once_call(record, ttl)
    return bool(conn.eval(_WRITE_ONCE, len(script_keys), *script_keys, *args))


def has_result(conn: Redis, job_id: str) -> bool:
    """Whether the job already has its result record."""
    return bool(conn.exists(keys.result_key(job_id)))


def read_result(conn: Redis, job_id: str) -> ResultRecord | None:
    """The job's result record, or None if it has none (yet, or any more)."""
    raw = conn.get(keys.result_key(job_id))
    return ResultRecord.model_validate_json(raw) if raw else None


def read_results(conn: Redis, job_ids: Sequence[str]) -> list[ResultRecord | None]:
    """Result records of many jobs in one round trip, in the order given."""
    if not job_ids:
        return []
    raws = conn.mget([keys.result_key(j) for j in job_ids])
    return [ResultRecord.model_validate_json(r) if r else None for r in raws]
