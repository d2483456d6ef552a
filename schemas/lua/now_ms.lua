-- Sets now_ms: Redis's clock (TIME) in milliseconds. Included by scripts that time leases.
local clock = redis.call('TIME')
local now_ms = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
