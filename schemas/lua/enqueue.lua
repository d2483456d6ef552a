-- KEYS: batch jobs list, batch hash, batch queues set, rq:queues.
-- ARGV: job key prefix, queue key prefix, TTL, enqueued_at, timeout, number of
--       queues Q, Q queue names, then (job id, queue index 1..Q, data, custom_id, model)
--       per job, then ``own``, ``most`` and ``notify``. A job's ``model`` (may be "")
--       goes on its hash: takes prefer jobs of models a worker holds (``affine.lua``).
-- Returns the batch's new total, or -1 (nothing written) when ``most`` (0: no limit)
-- jobs already wait on the first queue. A non-empty ``notify`` (a gateway process's
-- list, ``schemas.keys.notify_key``) is set on the batch hash: record writers push
-- each ended job's id there. A job whose hash exists is skipped (it is in the batch
-- already): a chunk sent twice (a retry after a lost reply) is enqueued once, and the
-- second call answers with the total, not -1, when the queue has filled meanwhile.
-- A non-empty ``own`` (the batch id) lets the batch take turns with its tenant's other
-- batches (``fair.lua``): its first chunk for a queue whose list holds work (or has a
-- ring) puts its jobs on the batch's own list ``<queue>#<own>``, an empty one on the
-- queue's; the choice is kept on the batch hash (``list:<queue>``) for later chunks.
--! include fair
local jp, qp, ttl, at, timeout = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5]
local nq = tonumber(ARGV[6])
local names, per = {}, {}
for i = 1, nq do names[i] = ARGV[6 + i]; per[i] = {} end
local own, most, notify = ARGV[#ARGV - 2], tonumber(ARGV[#ARGV - 1]), ARGV[#ARGV]
local fresh = {}
for i = 7 + nq, #ARGV - 3, 5 do
  if redis.call('EXISTS', jp .. ARGV[i]) == 0 then table.insert(fresh, i) end
end
if #fresh == 0 then return tonumber(redis.call('HGET', KEYS[2], 'total') or 0) end
if most > 0 and redis.call('LLEN', qp .. names[1]) >= most then return -1 end
local lists = {}
for i = 1, nq do
  lists[i] = names[i]
  if own ~= '' then
    local field = 'list:' .. names[i]
    local kept = redis.call('HGET', KEYS[2], field)
    if kept then
      lists[i] = kept
    else
      if redis.call('LLEN', qp .. names[i]) > 0
        or redis.call('EXISTS', {{RING_PREFIX}} .. names[i]) == 1 then
        lists[i] = names[i] .. '#' .. own
      end
      redis.call('HSET', KEYS[2], field, lists[i])
    end
  end
end
local ids = {}
for _, i in ipairs(fresh) do
  local id, q = ARGV[i], tonumber(ARGV[i + 1])
  redis.call('HSET', jp .. id, 'data', ARGV[i + 2], 'status', 'queued', 'origin', lists[q],
    'enqueued_at', at, 'timeout', timeout, 'description', ARGV[i + 3])
  if ARGV[i + 4] ~= '' then redis.call('HSET', jp .. id, 'model', ARGV[i + 4]) end
  table.insert(per[q], id)
  table.insert(ids, id)
end
local function push(key, list)
  for i = 1, #list, 1000 do
    redis.call('RPUSH', key, unpack(list, i, math.min(i + 999, #list)))
  end
end
for i = 1, nq do
  if #per[i] > 0 then
    push(qp .. lists[i], per[i])
    fair_join(lists[i])
    fair_wake(names[i], #per[i] - 1)  -- (fair_join woke one): one idle worker per job
    redis.call('SADD', KEYS[3], lists[i])
    redis.call('SADD', KEYS[4], qp .. names[i])
  end
end
push(KEYS[1], ids)
if notify ~= '' then redis.call('HSET', KEYS[2], 'notify', notify) end
redis.call('EXPIRE', KEYS[1], ttl)
redis.call('EXPIRE', KEYS[2], ttl)
redis.call('EXPIRE', KEYS[3], ttl)
return redis.call('HINCRBY', KEYS[2], 'total', #ids)
