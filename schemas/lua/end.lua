-- End a held job: write its record once, then RQ's bookkeeping, then let go of it.
-- KEYS: result, batch hash, batch done list, running, rq job hash, started registry,
--       finished or failed registry, rq worker hash, rq results stream
-- ARGV: record JSON, TTL, counter field, job id, finished_at, token, RQ status,
--       ended_at (RQ format), worker counter field, seconds worked, the error for
--       RQ's result stream (as RQ stores it: base64 of zlib; "" when it succeeded),
--       worker name, the job hash's new ``data`` ("": keep it; a succeeded job's
--       request is dropped: ``schemas.ENDED_JOB_DATA``, a call with no arguments),
--       the day's usage hash ("": none), the tenant, prompt tokens, completion tokens
-- An empty record JSON writes no record (a refused job nobody can be told about).
-- Returns 1 if this call wrote the record (0: none written, or the job had one).
-- Safe to run twice (a retry after a lost reply): the second call finds the hold gone
-- and the record written, so it neither counts the job on the worker again nor adds
-- a second entry to RQ's results stream.
-- A job ``producer retry`` queued again (job hash field ``retrying``) ends by replacing
-- its old record: the holder drops it first, so the write below stores and counts the
-- new one (the retry took the job off the batch's ``failed`` count); with no new record
-- the old one stays and is counted failed again.
local id, token = ARGV[4], ARGV[6]
local holder = redis.call('HGET', KEYS[4], id)
local released = holder and string.sub(holder, 1, #token + 1) == token .. ' '
if released then redis.call('HDEL', KEYS[4], id) end
if released and redis.call('HDEL', KEYS[5], 'retrying') == 1 then
  if ARGV[1] ~= '' then
    redis.call('DEL', KEYS[1])
  else
    redis.call('HINCRBY', KEYS[2], 'failed', 1)
  end
end
--! include write_once_body
--! include now_ms

local counts = released or fresh == 1
redis.call('ZREM', KEYS[6], id .. ':' .. token)
if redis.call('EXISTS', KEYS[5]) == 1 then
  redis.call('HSET', KEYS[5], 'status', ARGV[7], 'ended_at', ARGV[8])
  if ARGV[13] ~= '' then redis.call('HSET', KEYS[5], 'data', ARGV[13]) end
  redis.call('EXPIRE', KEYS[5], ARGV[2])
  if ARGV[11] ~= '' and counts then
    redis.call('XADD', KEYS[9], 'MAXLEN', 10, '*', 'type', 2, 'worker_name', ARGV[12],
      'exc_string', ARGV[11])
    redis.call('EXPIRE', KEYS[9], ARGV[2])
  end
  redis.call('ZADD', KEYS[7], math.floor(now_ms / 1000) + tonumber(ARGV[2]), id)
end
if fresh == 1 and ARGV[14] and ARGV[14] ~= '' then  -- the tenant's usage, counted once
  local u, t = ARGV[14], ARGV[15]
  redis.call('HINCRBY', u, t .. ':jobs', 1)
  if ARGV[3] == 'failed' then redis.call('HINCRBY', u, t .. ':failed', 1) end
  redis.call('HINCRBY', u, t .. ':prompt_tokens', ARGV[16])
  redis.call('HINCRBY', u, t .. ':completion_tokens', ARGV[17])
  redis.call('HINCRBYFLOAT', u, t .. ':job_seconds', ARGV[10])
  redis.call('EXPIRE', u, {{USAGE_TTL}})
end
if counts and redis.call('EXISTS', KEYS[8]) == 1 then
  redis.call('HINCRBY', KEYS[8], ARGV[9], 1)
  redis.call('HINCRBYFLOAT', KEYS[8], 'total_working_time', ARGV[10])
end
return wrote
