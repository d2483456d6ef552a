-- Remove expired entries (score <= now, unix seconds) from RQ's finished and failed
-- registries, at most ARGV[1] per registry per call. Nothing else removes them: RQ's
-- own cleanup runs in RQ's workers, and a million finished jobs would otherwise
-- leave a million entries (~100 bytes each) behind their expired job hashes.
-- KEYS: registries. Returns how many entries were removed.
--! include now_ms

local n, now = 0, math.floor(now_ms / 1000)
for i = 1, #KEYS do
  local ids = redis.call('ZRANGEBYSCORE', KEYS[i], '-inf', now, 'LIMIT', 0, tonumber(ARGV[1]))
  if #ids > 0 then
    redis.call('ZREM', KEYS[i], unpack(ids))
    n = n + #ids
  end
end
return n
