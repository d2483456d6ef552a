-- Lua: write the record only if none exists (first write wins), then bump the batch
-- counter and announce the job on the batch's done list. Sets ``wrote``. KEYS[1..3]
-- are the result key, the batch hash and its done list; ARGV[1..5] the record JSON,
-- the TTL, the counter field, the job id and finished_at (an empty record JSON writes
-- nothing). If the batch names a listener (hash field ``notify``, a gateway process's
-- list), the record is pushed there too; ``pcall``: a hash field naming a key of
-- another type cannot stop the record. The worker's end-of-job script
-- (``worker.lifecycle.scripts.END``) starts with it. Run twice (a retry after a lost
-- reply), the second call finds this very record stored: it sets ``wrote`` again and
-- counts nothing (another writer's record differs in its times and metrics).
-- ``fresh`` is 1 only when this call stored it.
local wrote, fresh = 0, 0
if ARGV[1] ~= '' and redis.call('SET', KEYS[1], ARGV[1], 'NX', 'EX', ARGV[2]) then
  redis.call('HINCRBY', KEYS[2], ARGV[3], 1)
  redis.call('HSETNX', KEYS[2], 'first_done_at', ARGV[5])
  redis.call('HSET', KEYS[2], 'last_done_at', ARGV[5])
  redis.call('EXPIRE', KEYS[2], ARGV[2])
  redis.call('RPUSH', KEYS[3], ARGV[4])
  redis.call('EXPIRE', KEYS[3], ARGV[2])
  local notify = redis.call('HGET', KEYS[2], 'notify')
  if notify and string.sub(notify, 1, #{{NOTIFY_PREFIX}}) == {{NOTIFY_PREFIX}} then
    redis.pcall('RPUSH', notify, ARGV[1])
    redis.pcall('EXPIRE', notify, {{NOTIFY_TTL}})
  end
  if ARGV[3] == 'failed' then  -- the batch's first failures, for pages and reports
    local errors = KEYS[2] .. ':errors'
    if redis.call('LLEN', errors) < {{ERRORS_KEPT}} then
      redis.call('RPUSH', errors, ARGV[4])
      redis.call('EXPIRE', errors, ARGV[2])
    end
  end
  -- the batch's last record: its tenant's webhook, if one is set, gets batch.completed
  local b = redis.call('HMGET', KEYS[2], 'total', 'succeeded', 'failed', 'tenant', 'retried')
  if b[4] and tonumber(b[1] or 0) > 0
    and tonumber(b[2] or 0) + tonumber(b[3] or 0) == tonumber(b[1])
    and redis.call('HEXISTS', {{WEBHOOK_URLS}}, b[4]) == 1 then
    local event = 'batch.completed ' .. string.match(KEYS[2], '[^:]+$') .. ' ' .. (b[5] or '0')
    redis.call('ZADD', {{WEBHOOKS}}, 'NX', ARGV[5], event)
    redis.call('HSETNX', {{WEBHOOKS}} .. ':since', event, ARGV[5])
  end
  wrote, fresh = 1, 1
elseif ARGV[1] ~= '' and redis.call('GET', KEYS[1]) == ARGV[1] then
  wrote = 1
end
