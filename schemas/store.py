"""Reading and writing result records: the write-once protocol every writer follows."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from schemas import keys
from schemas.result import ResultRecord

if TYPE_CHECKING:
    from redis import Redis

#: Lua: write the record only if none exists (first write wins), then bump the batch
#: counter and announce the job on the batch's done list. Sets ``wrote``. KEYS[1..3]
#: are the result key, the batch hash and its done list; ARGV[1..5] the record JSON,
#: the TTL, the counter field, the job id and finished_at (an empty record JSON writes
#: nothing). If the batch names a listener (hash field ``notify``, a gateway process's
#: list), the record is pushed there too; ``pcall``: a hash field naming a key of
#: another type cannot stop the record. The worker's end-of-job script
#: (``worker.scripts.END``) starts with it.
WRITE_ONCE_LUA = """
local wrote = 0
if ARGV[1] ~= '' and redis.call('SET', KEYS[1], ARGV[1], 'NX', 'EX', ARGV[2]) then
  redis.call('HINCRBY', KEYS[2], ARGV[3], 1)
  redis.call('HSETNX', KEYS[2], 'first_done_at', ARGV[5])
  redis.call('HSET', KEYS[2], 'last_done_at', ARGV[5])
  redis.call('EXPIRE', KEYS[2], ARGV[2])
  redis.call('RPUSH', KEYS[3], ARGV[4])
  redis.call('EXPIRE', KEYS[3], ARGV[2])
  local notify = redis.call('HGET', KEYS[2], 'notify')
  if notify and string.sub(notify, 1, #NOTIFY_PREFIX) == NOTIFY_PREFIX then
    redis.pcall('RPUSH', notify, ARGV[1])
    redis.pcall('EXPIRE', notify, NOTIFY_TTL)
  end
  wrote = 1
end
""".replace("NOTIFY_PREFIX", f"'{keys.NOTIFY_PREFIX}'").replace("NOTIFY_TTL", str(keys.NOTIFY_TTL))

_WRITE_ONCE = WRITE_ONCE_LUA + "return wrote\n"


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
