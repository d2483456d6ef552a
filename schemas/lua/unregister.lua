-- A clean exit: hand back anything still held or in the inbox, end the lease.
-- KEYS: running, leases, holders, inbox. ARGV: token, job key prefix, started key
-- prefix, queue key prefix, inbox queue. Returns the ids handed back.
--! include fair
local out = {}
local entries = redis.call('HGETALL', KEYS[1])
for i = 1, #entries, 2 do
  local id = entries[i]
  local tok, queue = string.match(entries[i + 1], '^(%S+) (.*)$')
  if tok == ARGV[1] then
    redis.call('HDEL', KEYS[1], id)
    redis.call('ZREM', ARGV[3] .. fair_lane(queue), id .. ':' .. tok)
    if redis.call('EXISTS', ARGV[2] .. id) == 1 then
      redis.call('HSET', ARGV[2] .. id, 'status', 'queued')
    end
    redis.call('LPUSH', ARGV[4] .. queue, id)
    fair_join(queue, true)
    table.insert(out, id)
  end
end
while true do
  local id = redis.call('LMOVE', KEYS[4], ARGV[4] .. ARGV[5], 'RIGHT', 'LEFT')
  if not id then break end
  fair_join(ARGV[5])
  table.insert(out, id)
end
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('HDEL', KEYS[3], ARGV[1])
return out
