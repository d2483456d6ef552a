-- Queue failed jobs of a batch again (``producer retry``): the old record stays until
-- the new run's end replaces it (``end.lua``); the batch counts the job as not ended.
-- KEYS: batch hash, rq:queues, running.
-- ARGV: job key prefix, result key prefix, queue key prefix, failed registry prefix,
--       crash counter prefix, enqueued_at (RQ time), then (job id, record JSON) pairs:
--       the record the caller read and matched against its filter.
-- Returns {"cancelled"} (nothing done), or {queued, pending, changed, unkept}: jobs
-- queued again, jobs already queued again or running (a retry sent twice), jobs whose
-- record is no longer the one read (ended again meanwhile), jobs whose request is not
-- kept (written outside a run: an invalid line, a lost job hash).
--! include fair
if redis.call('HEXISTS', KEYS[1], 'cancelled_at') == 1 then return {'cancelled'} end
local jp, rp, qp, fp, cp, at = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6]
local queued, pending, changed, unkept = 0, 0, 0, 0
for i = 7, #ARGV, 2 do
  local id, seen = ARGV[i], ARGV[i + 1]
  local job = jp .. id
  if redis.call('HEXISTS', job, 'retrying') == 1 or redis.call('HEXISTS', KEYS[3], id) == 1 then
    pending = pending + 1
  elseif redis.call('GET', rp .. id) ~= seen then
    changed = changed + 1
  else
    local origin = redis.call('HGET', job, 'origin')
    if not origin or redis.call('HEXISTS', job, 'data') == 0 then
      unkept = unkept + 1
    else
      redis.call('HSET', job, 'status', 'queued', 'enqueued_at', at, 'retrying', '1')
      redis.call('HINCRBY', job, 'retries', 1)
      redis.call('HDEL', job, 'started_at', 'ended_at', 'worker_name')
      redis.call('DEL', cp .. id)
      redis.call('ZREM', fp .. fair_lane(origin), id)
      redis.call('RPUSH', qp .. origin, id)
      fair_join(origin)
      redis.call('SADD', KEYS[2], qp .. fair_lane(origin))
      queued = queued + 1
    end
  end
end
if queued > 0 then
  redis.call('HINCRBY', KEYS[1], 'failed', -queued)
  redis.call('HINCRBY', KEYS[1], 'retried', queued)
  -- the output files' sizes the gateway kept for an ended batch are stale now
  redis.call('HDEL', KEYS[1], 'out_bytes', 'err_bytes')
end
return {queued, pending, changed, unkept}
