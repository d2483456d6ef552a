-- Lua: ``drop(job_key, ttl)`` replaces a job hash by ``{status: canceled,
-- description: <custom_id>}`` that lives ``ttl`` seconds (the batch record's, from
-- ``batch_ttl(batch_key)``).
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
