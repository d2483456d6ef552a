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
local function fair_pop(list, name)
  local fair = {{FAIR_PREFIX}} .. name
  for _ = 1, {{FAIR_SCAN}} do
    local head = redis.call('ZRANGE', fair, 0, 0, 'WITHSCORES')
    if #head == 0 then break end
    local member = head[1]
    local id = redis.call('LPOP', {{QUEUE_PREFIX}} .. member)
    if id then
      redis.call('ZADD', fair, tonumber(head[2]) + 1 / fair_weight(member), member)
      return id, member
    end
    redis.call('ZREM', fair, member)
  end
  return redis.call('LPOP', list), name
end
