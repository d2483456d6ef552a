-- Give a held job back, unstarted, to the front of its queue.
-- KEYS: running, queue list, rq job hash, started registry. ARGV: token, id, queue.
-- Returns 1, or 0 if this token does not hold the job (recovery took it back).
--! include fair
if redis.call('HGET', KEYS[1], ARGV[2]) ~= ARGV[1] .. ' ' .. ARGV[3] then return 0 end
redis.call('HDEL', KEYS[1], ARGV[2])
redis.call('ZREM', KEYS[4], ARGV[2] .. ':' .. ARGV[1])
if redis.call('EXISTS', KEYS[3]) == 1 then redis.call('HSET', KEYS[3], 'status', 'queued') end
redis.call('LPUSH', KEYS[2], ARGV[2])
fair_give_back(ARGV[3])
return 1
