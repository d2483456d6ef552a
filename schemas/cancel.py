"""Cancelled batches: a flag on the batch record that every job taker checks.

``producer cancel`` sets ``cancelled_at`` on ``mlxq:batch:<id>`` (one command,
whatever the batch's size). From then on a worker never starts a job of that
batch: :data:`DROP_LUA` runs on each such id a worker's take (or the cancel
command's own sweep of the queue heads) pops. The job gets no result record;
readers (``producer status`` / ``results``, :class:`producer.Client`) count it
cancelled from the flag. Its hash shrinks to its status and custom_id until the
batch record expires, so ``producer results`` can still name it.
"""

from __future__ import annotations

#: Lua: ``drop(job_key, ttl)`` replaces a job hash by ``{status: canceled,
#: description: <custom_id>}`` that lives ``ttl`` seconds (the batch record's, from
#: ``batch_ttl(batch_key)``).
DROP_LUA = """
local function batch_ttl(batch)
  local ttl = redis.call('TTL', batch)
  return ttl > 0 and ttl or 86400
end
local function drop(job, ttl)
  local cid = redis.call('HGET', job, 'description')
  redis.call('DEL', job)
  if cid then
    redis.call('HSET', job, 'status', 'canceled', 'description', cid)
    redis.call('EXPIRE', job, ttl)
  end
end
"""

#: The batch-hash field that marks a batch cancelled (unix seconds).
CANCELLED_AT = "cancelled_at"
