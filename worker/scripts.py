"""The job lifecycle's state transitions, each one Lua script (atomic in Redis).

Keys (names from ``schemas.keys``; ``<token>`` is one worker process's lease token)::

    rq:queue:<q>            list    RQ's queue of job ids (producers LPUSH/RPUSH)
    rq:job:<id>             hash    RQ's job (JSON call in ``data``; status, times)
    mlxq:running            hash    id -> "<token> <q>": every job a worker holds
    mlxq:leases             zset    token -> lease end (Redis server ms); one lease
                                    covers every job its process holds
    mlxq:holders            hash    token -> {"name", "host", "pid", "inbox_queue"}
    mlxq:inbox:<token>      list    an id a blocking wait moved off the first queue
    mlxq:result:<id>        string  the result record, written once
    mlxq:crashes:<id>       string  how often the job's holder died
    rq:wip:<q>              zset    RQ's started registry: "<id>:<token>" -> +inf
    rq:finished:<q>, rq:failed:<q>  RQ's registries: id -> expiry (unix s)
    rq:worker:<name>        hash    RQ's worker record (state, current_job, counts)

A job is *held* from the moment TAKE pops it until END (or REQUEUE) clears its
``mlxq:running`` entry, and its holder's lease covers it all that time, however
long the holder spends loading a model, prefilling or waiting on Redis. When a
lease runs out (the process died, or stalled longer than the lease), RECOVER
gives its jobs back: to the front of their queue, or to the recovering worker
to fail as poison once they have killed ``max_crashes`` holders. Leases are
timed by Redis's clock (TIME), so workers' clocks do not matter. RQ's started
registry entries are scored ``+inf``: RQ's own cleanups never act on them.
"""

from __future__ import annotations

from schemas.cancel import DROP_LUA
from schemas.store import WRITE_ONCE_LUA

_NOW_MS = """
local clock = redis.call('TIME')
local now_ms = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
"""

#: Take the next job (the inbox first, then the queues in order) and start it.
#: Jobs of a cancelled batch (its hash has ``cancelled_at``) are dropped on the way,
#: up to 1,000 per call (``schemas.cancel``), never started.
#: KEYS: running, leases, inbox, rq worker hash, rq:suspended, queue lists...
#: ARGV: token, lease ms, worker name, now (RQ time format), job key prefix,
#:       result key prefix, started key prefix, batch key prefix, the inbox's queue
#:       name, queue names (in the order of the queue keys)...
#: Returns false (nothing queued), {"suspended"}, {"dropped", n} (only cancelled jobs
#: came: call again), {"held"|"done"|"missing", id, queue} (a copy of a job held now /
#: one that has its record / an id with no hash: popped, not started) or
#: {"start", id, queue, {hash fields}}.
TAKE = (
    _NOW_MS
    + DROP_LUA
    + """
redis.call('ZADD', KEYS[2], now_ms + tonumber(ARGV[2]), ARGV[1])
if redis.call('EXISTS', KEYS[5]) == 1 and redis.call('LLEN', KEYS[3]) == 0 then
  return {'suspended'}
end
local id, queue, dropped = nil, nil, 0
while dropped < 1000 do
  id = redis.call('LPOP', KEYS[3])
  queue = ARGV[9]
  if not id then
    for i = 6, #KEYS do
      id = redis.call('LPOP', KEYS[i])
      if id then queue = ARGV[i + 4]; break end
    end
  end
  if not id then break end
  local batch = string.match(id, '^(.+)%-' .. string.rep('%x', 20) .. '$')
  if not batch or redis.call('HEXISTS', ARGV[8] .. batch, 'cancelled_at') == 0 then break end
  drop(ARGV[5] .. id, batch_ttl(ARGV[8] .. batch))
  dropped = dropped + 1
  id = nil
end
if not id then
  if dropped > 0 then return {'dropped', dropped} end
  if redis.call('HGET', KEYS[4], 'state') == 'busy' then
    redis.call('HSET', KEYS[4], 'state', 'idle')
    redis.call('HDEL', KEYS[4], 'current_job')
  end
  return false
end
if redis.call('HEXISTS', KEYS[1], id) == 1 then return {'held', id, queue} end
if redis.call('EXISTS', ARGV[6] .. id) == 1 then return {'done', id, queue} end
local job = ARGV[5] .. id
local fields = redis.call('HGETALL', job)
if #fields == 0 then return {'missing', id, queue} end
redis.call('HSET', KEYS[1], id, ARGV[1] .. ' ' .. queue)
redis.call('HSET', job, 'status', 'started', 'started_at', ARGV[4], 'last_heartbeat', ARGV[4],
  'worker_name', ARGV[3])
redis.call('ZADD', ARGV[7] .. queue, '+inf', id .. ':' .. ARGV[1])
if redis.call('EXISTS', KEYS[4]) == 1 then
  redis.call('HSET', KEYS[4], 'state', 'busy', 'current_job', id)
end
return {'start', id, queue, fields}
"""
)

#: End a held job: write its record once, then RQ's bookkeeping, then let go of it.
#: KEYS: result, batch hash, batch done list, running, rq job hash, started registry,
#:       finished or failed registry, rq worker hash, rq results stream
#: ARGV: record JSON, TTL, counter field, job id, finished_at, token, RQ status,
#:       ended_at (RQ format), worker counter field, seconds worked, the error for
#:       RQ's result stream (as RQ stores it: base64 of zlib; "" when it succeeded),
#:       worker name, the job hash's new ``data`` ("": keep it; a succeeded job's
#:       request is dropped: ``schemas.ENDED_JOB_DATA``, a call with no arguments)
#: An empty record JSON writes no record (a refused job nobody can be told about).
#: Returns 1 if this call wrote the record (0: none written, or the job had one).
END = (
    WRITE_ONCE_LUA
    + _NOW_MS
    + """
local id, token = ARGV[4], ARGV[6]
local holder = redis.call('HGET', KEYS[4], id)
if holder and string.sub(holder, 1, #token + 1) == token .. ' ' then
  redis.call('HDEL', KEYS[4], id)
end
redis.call('ZREM', KEYS[6], id .. ':' .. token)
if redis.call('EXISTS', KEYS[5]) == 1 then
  redis.call('HSET', KEYS[5], 'status', ARGV[7], 'ended_at', ARGV[8])
  if ARGV[13] ~= '' then redis.call('HSET', KEYS[5], 'data', ARGV[13]) end
  redis.call('EXPIRE', KEYS[5], ARGV[2])
  if ARGV[11] ~= '' then
    redis.call('XADD', KEYS[9], 'MAXLEN', 10, '*', 'type', 2, 'worker_name', ARGV[12],
      'exc_string', ARGV[11])
    redis.call('EXPIRE', KEYS[9], ARGV[2])
  end
  redis.call('ZADD', KEYS[7], math.floor(now_ms / 1000) + tonumber(ARGV[2]), id)
end
if redis.call('EXISTS', KEYS[8]) == 1 then
  redis.call('HINCRBY', KEYS[8], ARGV[9], 1)
  redis.call('HINCRBYFLOAT', KEYS[8], 'total_working_time', ARGV[10])
end
return wrote
"""
)

#: Give a held job back, unstarted, to the front of its queue.
#: KEYS: running, queue list, rq job hash, started registry. ARGV: token, id, queue.
#: Returns 1, or 0 if this token does not hold the job (recovery took it back).
REQUEUE = """
if redis.call('HGET', KEYS[1], ARGV[2]) ~= ARGV[1] .. ' ' .. ARGV[3] then return 0 end
redis.call('HDEL', KEYS[1], ARGV[2])
redis.call('ZREM', KEYS[4], ARGV[2] .. ':' .. ARGV[1])
if redis.call('EXISTS', KEYS[3]) == 1 then redis.call('HSET', KEYS[3], 'status', 'queued') end
redis.call('LPUSH', KEYS[2], ARGV[2])
return 1
"""

#: Extend this process's lease (registering it when absent), and RQ's worker heartbeat.
#: KEYS: leases, holders, rq worker hash. ARGV: token, lease ms, holder JSON,
#: now (RQ format), worker key TTL. Returns 1, or 0 if the lease had ended (recovery
#: has given its jobs back; the process goes on under a fresh lease).
RENEW = (
    _NOW_MS
    + """
local alive = redis.call('ZSCORE', KEYS[1], ARGV[1])
redis.call('ZADD', KEYS[1], now_ms + tonumber(ARGV[2]), ARGV[1])
if not alive then redis.call('HSET', KEYS[2], ARGV[1], ARGV[3]) end
if redis.call('EXISTS', KEYS[3]) == 1 then
  redis.call('HSET', KEYS[3], 'last_heartbeat', ARGV[4])
  redis.call('EXPIRE', KEYS[3], ARGV[5])
end
if alive then return 1 end
return 0
"""
)

#: Give back the jobs of every process whose lease ended (or that has none).
#: KEYS: running, leases, holders.
#: ARGV: recovering token, max crashes, crash counter TTL, job key prefix, result key
#:       prefix, started key prefix, queue key prefix, crash key prefix, inbox prefix.
#: Returns {kind, id, queue, crashes} per job: "requeued", "poison" (now held by the
#: recovering token, to be failed), "done" (it has its record), "gone" (no job hash),
#: "inbox" (moved back from a dead process's inbox).
RECOVER = (
    _NOW_MS
    + """
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
    redis.call('ZREM', ARGV[6] .. queue, id .. ':' .. tok)
    local job = ARGV[4] .. id
    if redis.call('EXISTS', ARGV[5] .. id) == 1 then
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
        redis.call('ZADD', ARGV[6] .. queue, '+inf', id .. ':' .. ARGV[1])
        table.insert(out, {'poison', id, queue, tostring(crashes)})
      else
        redis.call('HDEL', KEYS[1], id)
        redis.call('HSET', job, 'status', 'queued')
        redis.call('LPUSH', ARGV[7] .. queue, id)
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
      table.insert(out, {'inbox', id, queue, '0'})
    end
  end
  redis.call('DEL', inbox)
  redis.call('HDEL', KEYS[3], tok)
  redis.call('ZREM', KEYS[2], tok)
end
return out
"""
)

#: Remove expired entries (score <= now, unix seconds) from RQ's finished and failed
#: registries, at most ARGV[1] per registry per call. Nothing else removes them: RQ's
#: own cleanup runs in RQ's workers, and a million finished jobs would otherwise
#: leave a million entries (~100 bytes each) behind their expired job hashes.
#: KEYS: registries. Returns how many entries were removed.
PRUNE = (
    _NOW_MS
    + """
local n, now = 0, math.floor(now_ms / 1000)
for i = 1, #KEYS do
  local ids = redis.call('ZRANGEBYSCORE', KEYS[i], '-inf', now, 'LIMIT', 0, tonumber(ARGV[1]))
  if #ids > 0 then
    redis.call('ZREM', KEYS[i], unpack(ids))
    n = n + #ids
  end
end
return n
"""
)

#: A clean exit: hand back anything still held or in the inbox, end the lease.
#: KEYS: running, leases, holders, inbox. ARGV: token, job key prefix, started key
#: prefix, queue key prefix, inbox queue. Returns the ids handed back.
UNREGISTER = """
local out = {}
local entries = redis.call('HGETALL', KEYS[1])
for i = 1, #entries, 2 do
  local id = entries[i]
  local tok, queue = string.match(entries[i + 1], '^(%S+) (.*)$')
  if tok == ARGV[1] then
    redis.call('HDEL', KEYS[1], id)
    redis.call('ZREM', ARGV[3] .. queue, id .. ':' .. tok)
    if redis.call('EXISTS', ARGV[2] .. id) == 1 then
      redis.call('HSET', ARGV[2] .. id, 'status', 'queued')
    end
    redis.call('LPUSH', ARGV[4] .. queue, id)
    table.insert(out, id)
  end
end
while true do
  local id = redis.call('LMOVE', KEYS[4], ARGV[4] .. ARGV[5], 'RIGHT', 'LEFT')
  if not id then break end
  table.insert(out, id)
end
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('HDEL', KEYS[3], ARGV[1])
return out
"""
