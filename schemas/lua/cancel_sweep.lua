-- Drop the cancelled batch's ids at the head of a queue, at most ARGV[3] per call.
-- KEYS: queue list, batch hash. ARGV: job key prefix, "<batch id>-", limit.
-- Returns how many were dropped.
--! include drop

local prefix, pattern = ARGV[2], '^' .. string.rep('%x', 20) .. '$'
local head = redis.call('LRANGE', KEYS[1], 0, tonumber(ARGV[3]) - 1)
local n = 0
for _, id in ipairs(head) do
  if string.sub(id, 1, #prefix) ~= prefix or not string.match(string.sub(id, #prefix + 1), pattern)
  then break end
  n = n + 1
end
if n == 0 then return 0 end
redis.call('LTRIM', KEYS[1], n, -1)
local ttl = batch_ttl(KEYS[2])
for i = 1, n do drop(ARGV[1] .. head[i], ttl, KEYS[2]) end
return n
