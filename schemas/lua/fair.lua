-- Lua: fair share over tenants (``producer submit --tenant``). A tenant's jobs on queue Q
-- wait on their own list, ``Q@<tenant>`` (the default tenant's on Q itself); the sorted
-- set ``mlxq:fair:Q`` holds the lists with work, scored by virtual time. ``fair_pop``
-- takes from the list of least virtual time and advances it by 1/weight (weights in
-- ``mlxq:tenants``), so tenants with work share a queue's takes in proportion to their
-- weights, whatever each has queued; a list found empty leaves the set. ``fair_join``,
-- run by every script that puts an id on a list, brings the list (back) in at the least
-- virtual time present: a tenant that was idle banks no credit.
local function fair_join(name)
  local base = string.match(name, '^(.-)@')
  local fair = {{FAIR_PREFIX}} .. (base or name)
  if not base and redis.call('EXISTS', fair) == 0 then return end
  local least = redis.call('ZRANGE', fair, 0, 0, 'WITHSCORES')[2] or '0'
  redis.call('ZADD', fair, 'NX', least, name)
  if base then redis.call('ZADD', fair, 'NX', least, base) end
end
local function fair_weight(name)
  local tenant = string.match(name, '@(.+)$') or {{DEFAULT_TENANT}}
  return tonumber(redis.call('HGET', {{TENANTS}}, tenant) or '') or 1
end
-- A job handed back unstarted (``requeue.lua``) gives its take back: its list's turn
-- comes again next, as the job is first on it.
local function fair_give_back(name)
  local fair = {{FAIR_PREFIX}} .. (string.match(name, '^(.-)@') or name)
  if redis.call('ZSCORE', fair, name) then
    redis.call('ZINCRBY', fair, -1 / fair_weight(name), name)
  else
    fair_join(name)
  end
end
-- A tenant with a running limit (``mlxq:tenant-limits``) whose jobs held fleet-wide
-- (``mlxq:running``, counted only for such tenants) reach it is passed over: its jobs
-- wait, its turn keeps.
local function fair_full(member, held)
  local tenant = string.match(member, '@(.+)$')
  if not tenant then return false end
  local limit = tonumber(redis.call('HGET', {{LIMITS}}, tenant) or '')
  if not limit then return false end
  if not held.values then held.values = redis.call('HVALS', {{RUNNING}}) end
  local n, suffix = 0, '@' .. tenant
  for _, v in ipairs(held.values) do
    if string.sub(v, -#suffix) == suffix then n = n + 1 end
  end
  return n >= limit
end
local function fair_pop(list, name)
  local fair = {{FAIR_PREFIX}} .. name
  local members = redis.call('ZRANGE', fair, 0, {{FAIR_SCAN}} - 1, 'WITHSCORES')
  local held = {}
  for j = 1, #members, 2 do
    local member = members[j]
    if not fair_full(member, held) then
      local id = redis.call('LPOP', {{QUEUE_PREFIX}} .. member)
      if id then
        redis.call('ZADD', fair, tonumber(members[j + 1]) + 1 / fair_weight(member), member)
        return id, member
      end
      redis.call('ZREM', fair, member)
    end
  end
  return redis.call('LPOP', list), name
end
