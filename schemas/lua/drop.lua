-- Lua: ``drop(job_key, ttl, batch_key)`` replaces a job hash by ``{status: canceled,
-- description: <custom_id>}`` that lives ``ttl`` seconds (the batch record's, from
-- ``batch_ttl(batch_key)``). A job ``producer retry`` queued again (field ``retrying``)
-- keeps its failed record: it is failed again, counted so on the batch, its hash kept.
local function batch_ttl(batch)
  local ttl = redis.call('TTL', batch)
  return ttl > 0 and ttl or 86400
end
local function drop(job, ttl, batch)
  if redis.call('HEXISTS', job, 'retrying') == 1 then
    redis.call('HDEL', job, 'retrying')
    redis.call('HSET', job, 'status', 'failed')
    redis.call('HINCRBY', batch, 'failed', 1)
    return
  end
  local cid = redis.call('HGET', job, 'description')
  redis.call('DEL', job)
  if cid then
    redis.call('HSET', job, 'status', 'canceled', 'description', cid)
    redis.call('EXPIRE', job, ttl)
  end
end
