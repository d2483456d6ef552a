-- Lua: fair share over tenants (``producer submit --tenant``), and priority within one
-- (``--priority``). A tenant's jobs on queue Q wait on their own list, ``Q@<tenant>``
-- (the default tenant's on Q itself); its batches of priority P != 0 on ``Q@<tenant>^P``.
-- The sorted set ``mlxq:fair:Q`` holds the lists with work, scored by their tenant's
-- virtual time less P * EPS (so a tenant's lists sit together, its highest priority
-- first). ``fair_pop`` takes from the first list, and advances every list of that
-- tenant by 1/weight (weights in ``mlxq:tenants``): tenants with work share a queue's
-- takes in proportion to their weights, whatever each has queued, and within a tenant
-- the highest priority goes first. A list found empty leaves the set. ``fair_join``,
-- run by every script that puts an id on a list, brings the list (back) in at its
-- tenant's virtual time, or the least present: a tenant that was idle banks no credit.
-- The set ``mlxq:fair:Q@<tenant>:ranked`` names the tenant's lists of priority != 0.
-- Within one tenant's list of one priority (a lane), batches take turns: a batch
-- submitted while its lane holds work waits on its own list ``<lane>#<batch>``
-- (``enqueue.lua``), and the ring ``mlxq:ring:<lane>`` names the lane's lists with work
-- (the lane's own among them then), in turn order: each take from the lane takes from
-- the ring's first list and moves it last. A lane with no ring is one list, FIFO.
local FAIR_EPS = 1e-4  -- priorities apart (|P| <= 9: under a take's step, >= 1/100)
local function fair_lane(name)  -- the lane of a batch's own list (or of a lane: itself)
  return string.match(name, '^([^#]*)')
end
local function fair_parts(name)  -- base queue, tenant, priority
  name = fair_lane(name)
  local base, rest = string.match(name, '^(.-)@(.+)$')
  if not base then return name, {{DEFAULT_TENANT}}, 0 end
  local tenant, p = string.match(rest, '^(.-)%^(%-?%d+)$')
  if tenant then return base, tenant, tonumber(p) end
  return base, rest, 0
end
local function fair_ranked(base, tenant)
  return {{FAIR_PREFIX}} .. base .. '@' .. tenant .. ':ranked'
end
-- Every list of the tenant: its priority 0 list, then its ranked ones.
local function fair_lists(base, tenant)
  local plain = base
  if tenant ~= {{DEFAULT_TENANT}} then plain = base .. '@' .. tenant end
  local lists = redis.call('SMEMBERS', fair_ranked(base, tenant))
  table.insert(lists, 1, plain)
  return lists
end
local function fair_time(member, score)  -- a member's tenant's virtual time
  local _, _, p = fair_parts(member)
  return tonumber(score) + p * FAIR_EPS
end
-- The tenant's virtual time (from any of its lists in the set), or nil.
local function fair_tenant_time(fair, base, tenant)
  for _, l in ipairs(fair_lists(base, tenant)) do
    local score = redis.call('ZSCORE', fair, l)
    if score then return fair_time(l, score) end
  end
  return nil
end
local function fair_enter(fair, name)
  local base, tenant, p = fair_parts(name)
  if redis.call('ZSCORE', fair, name) then return end
  local t = fair_tenant_time(fair, base, tenant)
  if not t then
    local least = redis.call('ZRANGE', fair, 0, 0, 'WITHSCORES')
    t = least[1] and fair_time(least[1], least[2]) or 0
  end
  redis.call('ZADD', fair, t - p * FAIR_EPS, name)
  if p ~= 0 then redis.call('SADD', fair_ranked(base, tenant), name) end
end
-- Wake up to ``n`` idle workers of the queue ``name`` belongs to: tokens on
-- ``mlxq:wake:<queue>`` (at most {{WAKE_MAX}}, for {{WAKE_TTL}} s), which an idle worker
-- blocks on; a token is a hint (the worker runs a take), so a lost one costs nothing.
local function fair_wake(name, n)
  if n < 1 then return end
  local key = {{WAKE_PREFIX}} .. fair_parts(name)
  local tokens = {}
  for i = 1, math.min(n, {{WAKE_MAX}}) do tokens[i] = '1' end
  redis.call('RPUSH', key, unpack(tokens))
  redis.call('LTRIM', key, -{{WAKE_MAX}}, -1)
  redis.call('EXPIRE', key, {{WAKE_TTL}})
end
-- Bring the list ``name`` into its lane's ring (last, or ``front``: its turn next) when
-- the lane has one or ``name`` is a batch's own list; the lane's own list comes in
-- first when it holds work and the ring is new.
local function lane_join(name, front)
  local lane = fair_lane(name)
  local ring = {{RING_PREFIX}} .. lane
  local fresh = redis.call('EXISTS', ring) == 0
  if name == lane and fresh then return end
  if front then redis.call('LREM', ring, 1, name)
  elseif redis.call('LPOS', ring, name) then return end
  if name ~= lane and fresh and redis.call('LLEN', {{QUEUE_PREFIX}} .. lane) > 0 then
    redis.call('RPUSH', ring, lane)
  end
  redis.call(front and 'LPUSH' or 'RPUSH', ring, name)
end
local function fair_lpop(key) return redis.call('LPOP', key) end
-- The next job of the lane, from the list whose turn it is, and that list (a list found
-- empty leaves the ring); with no ring, the lane's own list's first. ``pop`` takes a job
-- from a list's key (default its first; the take's is model-affine, ``affine.lua``).
local function lane_pop(lane, pop)
  pop = pop or fair_lpop
  local ring = {{RING_PREFIX}} .. lane
  for _ = 1, {{FAIR_SCAN}} do
    local name = redis.call('LMOVE', ring, ring, 'LEFT', 'RIGHT')
    if not name then break end
    local id = pop({{QUEUE_PREFIX}} .. name)
    if id then return id, name end
    redis.call('LREM', ring, -1, name)
  end
  return pop({{QUEUE_PREFIX}} .. lane), lane
end
-- ``front``: a job went back to the front of its list (handed back, recovered): that
-- list's turn comes next within its lane.
local function fair_join(name, front)
  fair_wake(name, 1)
  lane_join(name, front)
  name = fair_lane(name)
  local base = fair_parts(name)
  local fair = {{FAIR_PREFIX}} .. base
  if name == base and redis.call('EXISTS', fair) == 0 then return end
  fair_enter(fair, name)
  if name ~= base then fair_enter(fair, base) end
end
local function fair_weight(tenant)
  return tonumber(redis.call('HGET', {{TENANTS}}, tenant) or '') or 1
end
-- The tenant of ``name`` at virtual time ``t``: each of its lists in the set re-scored.
local function fair_move(fair, name, t)
  local base, tenant = fair_parts(name)
  for _, l in ipairs(fair_lists(base, tenant)) do
    local _, _, p = fair_parts(l)
    redis.call('ZADD', fair, 'XX', t - p * FAIR_EPS, l)
  end
end
local function fair_leave(fair, name)
  local base, tenant, p = fair_parts(name)
  redis.call('ZREM', fair, name)
  if p ~= 0 then redis.call('SREM', fair_ranked(base, tenant), name) end
end
-- A job handed back unstarted (``requeue.lua``) gives its take back: its list's turn
-- comes again next, as the job is first on it.
local function fair_give_back(name)
  lane_join(name, true)
  name = fair_lane(name)
  local base, tenant = fair_parts(name)
  local fair = {{FAIR_PREFIX}} .. base
  local score = redis.call('ZSCORE', fair, name)
  if score then
    fair_wake(name, 1)
    fair_move(fair, name, fair_time(name, score) - 1 / fair_weight(tenant))
  else
    fair_join(name)  -- (which wakes)
  end
end
-- A tenant with a running limit (``mlxq:tenant-limits``) whose jobs held fleet-wide
-- (``mlxq:running``, counted only for such tenants) reach it is passed over: its jobs
-- wait, its turn keeps.
local function fair_full(member, held)
  local _, tenant = fair_parts(member)
  if tenant == {{DEFAULT_TENANT}} then return false end
  local limit = tonumber(redis.call('HGET', {{LIMITS}}, tenant) or '')
  if not limit then return false end
  if not held.values then held.values = redis.call('HVALS', {{RUNNING}}) end
  local n = 0
  for _, v in ipairs(held.values) do  -- "<token> <list>"
    if string.match(v, '@([%w_%-]+)') == tenant then n = n + 1 end
  end
  return n >= limit
end
local function fair_pop(name, pop)
  local fair = {{FAIR_PREFIX}} .. name
  local members = redis.call('ZRANGE', fair, 0, {{FAIR_SCAN}} - 1, 'WITHSCORES')
  local held = {}
  for j = 1, #members, 2 do
    local member = members[j]
    if not fair_full(member, held) then
      local id, from = lane_pop(member, pop)
      if id then
        local _, tenant = fair_parts(member)
        fair_move(fair, member, fair_time(member, members[j + 1]) + 1 / fair_weight(tenant))
        return id, from
      end
      fair_leave(fair, member)
    end
  end
  return lane_pop(name, pop)
end
