-- Give back the jobs of every process whose lease ended (or that has none).
-- KEYS: running, leases, holders.
-- ARGV: recovering token, max crashes, crash counter TTL, job key prefix, result key
--       prefix, started key prefix, queue key prefix, crash key prefix, inbox prefix.
-- Returns {kind, id, queue, crashes} per job: "requeued", "poison" (now held by the
-- recovering token, to be failed), "done" (it has its record), "gone" (no job hash),
-- "inbox" (moved back from a dead process's inbox).
--! include now_ms
--! include fair

local dead, any = {}, false
for _, tok in ipairs(redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now_ms)) do
  dead[tok] = true; any = true
end
local entries = redis.call('HGETALL', KEYS[1])
local function orphan(tok)
  if tok and not dead[tok] and not redis.call('ZSCORE', KEYS[2], tok) then
    dead[tok] = true; any = true
  end
end
for i = 2, #entries, 2 do orphan(string.match(entries[i], '^(%S+) ')) end
for _, tok in ipairs(redis.call('HKEYS', KEYS[3])) do orphan(tok) end
if not any then return {} end
local out = {}
for i = 1, #entries, 2 do
  local id = entries[i]
  local tok, queue = string.match(entries[i + 1], '^(%S+) (.*)$')
  if tok and dead[tok] then
    redis.call('ZREM', ARGV[6] .. fair_lane(queue), id .. ':' .. tok)
    local job = ARGV[4] .. id
    local retrying = redis.call('HEXISTS', job, 'retrying') == 1  -- producer retry
    if not retrying and redis.call('EXISTS', ARGV[5] .. id) == 1 then
      redis.call('HDEL', KEYS[1], id)
      if redis.call('EXISTS', job) == 1 then redis.call('HSET', job, 'status', 'finished') end
      table.insert(out, {'done', id, queue, '0'})
    elseif redis.call('EXISTS', job) == 0 then
      redis.call('HDEL', KEYS[1], id)
      table.insert(out, {'gone', id, queue, '0'})
    else
      local crashes = redis.call('INCR', ARGV[8] .. id)
      redis.call('EXPIRE', ARGV[8] .. id, ARGV[3])
      if crashes >= tonumber(ARGV[2]) then
        redis.call('HSET', KEYS[1], id, ARGV[1] .. ' ' .. queue)
        redis.call('ZADD', ARGV[6] .. fair_lane(queue), '+inf', id .. ':' .. ARGV[1])
        table.insert(out, {'poison', id, queue, tostring(crashes)})
      else
        redis.call('HDEL', KEYS[1], id)
        redis.call('HSET', job, 'status', 'queued')
        redis.call('LPUSH', ARGV[7] .. queue, id)
        fair_join(queue, true)
        table.insert(out, {'requeued', id, queue, tostring(crashes)})
      end
    end
  end
end
for tok, _ in pairs(dead) do
  local holder = redis.call('HGET', KEYS[3], tok)
  local inbox = ARGV[9] .. tok
  if holder then
    local ok, info = pcall(cjson.decode, holder)
    local queue = ok and type(info) == 'table' and info['inbox_queue']
    while queue do
      local id = redis.call('LMOVE', inbox, ARGV[7] .. queue, 'RIGHT', 'LEFT')
      if not id then break end
      fair_join(queue, true)
      table.insert(out, {'inbox', id, queue, '0'})
    end
  end
  redis.call('DEL', inbox)
  redis.call('HDEL', KEYS[3], tok)
  redis.call('ZREM', KEYS[2], tok)
end
return out
