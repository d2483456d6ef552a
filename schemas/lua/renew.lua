-- Extend this process's lease (registering it when absent), and RQ's worker heartbeat.
-- KEYS: leases, holders, rq worker hash. ARGV: token, lease ms, holder JSON,
-- now (RQ format), worker key TTL. Returns 1, or 0 if the lease had ended (recovery
-- has given its jobs back; the process goes on under a fresh lease).
--! include now_ms

local alive = redis.call('ZSCORE', KEYS[1], ARGV[1])
redis.call('ZADD', KEYS[1], now_ms + tonumber(ARGV[2]), ARGV[1])
if not alive then redis.call('HSET', KEYS[2], ARGV[1], ARGV[3]) end
if redis.call('EXISTS', KEYS[3]) == 1 then
  redis.call('HSET', KEYS[3], 'last_heartbeat', ARGV[4])
  redis.call('EXPIRE', KEYS[3], ARGV[5])
end
if alive then return 1 end
return 0
