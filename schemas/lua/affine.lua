-- Model-affine taking: a worker prefers jobs for the models it has loaded (the take's
-- ``warm`` names), so a queue mixing models does not make it load one for every job.
-- From the list whose turn it is, ``affine_pop`` takes its first job, unless that one
-- names a model not loaded, has waited (since it was enqueued) less than ``wait_ms``,
-- and one of the list's next {{AFFINE_SCAN}} jobs names a loaded model: then that one
-- (LREM: the others keep their order). So an older job for another model waits at most
-- ``wait_ms`` for this worker, and the worker switches once its models' work runs out.
-- A hash with no ``model`` field (written before) is taken in order. Needs ``now_ms``.
local function affine_ms(at)  -- RQ's time format (UTC) to unix milliseconds, or nil
  local y, mo, d, h, mi, s, frac = string.match(tostring(at),
    '^(%d+)%-(%d+)%-(%d+)T(%d+):(%d+):(%d+)%.?(%d*)')
  if not y then return nil end
  y, mo, d = tonumber(y), tonumber(mo), tonumber(d)
  if mo <= 2 then y = y - 1 end  -- days from the civil date (H. Hinnant's algorithm)
  local era = math.floor(y / 400)
  local yoe = y - era * 400
  local doy = math.floor((153 * ((mo + 9) % 12) + 2) / 5) + d - 1
  local days = era * 146097 + yoe * 365 + math.floor(yoe / 4) - math.floor(yoe / 100)
    + doy - 719468
  local ms = tonumber(string.sub(frac .. '000', 1, 3))
  return (((days * 24 + tonumber(h)) * 60 + tonumber(mi)) * 60 + tonumber(s)) * 1000 + ms
end
local function affine_pop(key, warm, wait_ms, job_prefix)
  if wait_ms <= 0 or next(warm) == nil then return redis.call('LPOP', key) end
  local ids = redis.call('LRANGE', key, 0, {{AFFINE_SCAN}} - 1)
  if #ids == 0 then return nil end
  local first = redis.call('HMGET', job_prefix .. ids[1], 'model', 'enqueued_at')
  if not first[1] or warm[first[1]] then return redis.call('LPOP', key) end
  local at = affine_ms(first[2])
  if not at or now_ms - at >= wait_ms then return redis.call('LPOP', key) end
  for i = 2, #ids do
    if warm[redis.call('HGET', job_prefix .. ids[i], 'model') or ''] then
      redis.call('LREM', key, 1, ids[i])
      return ids[i]
    end
  end
  return redis.call('LPOP', key)
end
