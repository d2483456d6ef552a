-- Take the next job (the inbox first, then the queues in order) and start it. A queue
-- with tenants' lists gives the job of the tenant whose turn it is (``fair.lua``); the
-- reply names the list it came from.
-- Jobs of a cancelled batch (its hash has ``cancelled_at``) are dropped on the way,
-- up to 1,000 per call (``schemas.cancel``), never started.
-- From each list, a job for a model the worker has loaded comes first, within a bound
-- per queue (``affine.lua``).
-- KEYS: running, leases, inbox, rq worker hash, rq:suspended, queue lists...
-- ARGV: token, lease ms, worker name, now (RQ time format), job key prefix,
--       result key prefix, started key prefix, batch key prefix, the inbox's queue
--       name, queue names (in the order of the queue keys)..., then per queue the
--       milliseconds a job for a model not loaded may be passed over (0: never), then
--       the names of the models the worker has loaded...
-- Returns false (nothing queued), {"suspended"}, {"dropped", n} (only cancelled jobs
-- came: call again), {"held"|"done"|"missing", id, queue} (a copy of a job held now /
-- one that has its record / an id with no hash: popped, not started) or
-- {"start", id, queue, {hash fields}}.
--! include now_ms
--! include drop
--! include fair
--! include affine

local nq = #KEYS - 5
local warm = {}
for i = 10 + 2 * nq, #ARGV do warm[ARGV[i]] = true end
redis.call('ZADD', KEYS[2], now_ms + tonumber(ARGV[2]), ARGV[1])
if redis.call('EXISTS', KEYS[5]) == 1 and redis.call('LLEN', KEYS[3]) == 0 then
  return {'suspended'}
end
local id, queue, dropped = nil, nil, 0
while dropped < 1000 do
  id = redis.call('LPOP', KEYS[3])
  queue = ARGV[9]
  if not id then
    for i = 6, #KEYS do
      local wait_ms = tonumber(ARGV[i + 4 + nq]) or 0
      id, queue = fair_pop(ARGV[i + 4], function(key)
        return affine_pop(key, warm, wait_ms, ARGV[5])
      end)
      if id then break end
    end
  end
  if not id then break end
  local batch = string.match(id, '^(.+)%-' .. string.rep('%x', 20) .. '$')
  if not batch or redis.call('HEXISTS', ARGV[8] .. batch, 'cancelled_at') == 0 then break end
  drop(ARGV[5] .. id, batch_ttl(ARGV[8] .. batch), ARGV[8] .. batch)
  dropped = dropped + 1
  id = nil
end
if not id then
  if dropped > 0 then return {'dropped', dropped} end
  if redis.call('HGET', KEYS[4], 'state') == 'busy' then
    redis.call('HSET', KEYS[4], 'state', 'idle')
    redis.call('HDEL', KEYS[4], 'current_job')
  end
  return false
end
if redis.call('HEXISTS', KEYS[1], id) == 1 then return {'held', id, queue} end
local job = ARGV[5] .. id
-- A job with its record is not run again, unless ``producer retry`` marked it (field
-- ``retrying``): its old record stays until the new run's end replaces it.
if redis.call('EXISTS', ARGV[6] .. id) == 1 and redis.call('HEXISTS', job, 'retrying') == 0 then
  return {'done', id, queue}
end
local fields = redis.call('HGETALL', job)
if #fields == 0 then return {'missing', id, queue} end
redis.call('HSET', KEYS[1], id, ARGV[1] .. ' ' .. queue)
redis.call('HSET', job, 'status', 'started', 'started_at', ARGV[4], 'last_heartbeat', ARGV[4],
  'worker_name', ARGV[3])
redis.call('ZADD', ARGV[7] .. fair_lane(queue), '+inf', id .. ':' .. ARGV[1])
if redis.call('EXISTS', KEYS[4]) == 1 then
  redis.call('HSET', KEYS[4], 'state', 'busy', 'current_job', id)
end
return {'start', id, queue, fields}
