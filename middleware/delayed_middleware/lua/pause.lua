-- PAUSE: hold or resume one pending message or schedule (schedulePause).
-- KEYS: 1 delayed stream, 2 index top, 3 ids hash, 4 bucket seq, 5 pending count,
--       6 history, 7 parked, 8 call tokens, 9 refill, 10 outbox; on Redis Cluster's
--       two-phase fire also 11 in-flight zset, 12 claims hash; the last key is the
--       moved hash (moved.lua): 11 on a single node, 13 on Cluster
-- ARGV: 1 bucket key prefix, 2 now ms, 3 history maxlen, 4 'pause' | 'resume',
--       5 the id (scheduleId, or a recurring envelope's id without one), 6 reason
--       (history), 7 wake channel;
--       with 'resume' also 8 the ref the caller read (compare-and-set), 9 the due ms
--       to re-index at, 10 the next due ms after it ('-': none needed, 'purge': the
--       last), 11 that next due as RFC 3339 ('-')
-- Returns {status, topic}: status 'paused' | 'resumed' | 'unknown' (no such id
-- pending) | 'parked' (held for a bad target: nothing to pause) | 'already' (paused
-- already, or resumed already) | 'busy' (Cluster: an occurrence is in flight
-- between CLAIM and RELEASE; the caller retries once it is released) | 'stale'
-- (resume: the ref changed since the caller read it; the caller re-reads).
--
-- A paused envelope leaves the due index (so no fire step or CLAIM can take it)
-- and the refill set; its ids-hash ref keeps its stream id and due time with the
-- flag 'p' and, in the 4th field, when it was paused:
--   "<stream id> <due ms> - <paused at ms> p"
-- Every script that drops a ref (replace, cancel, REFILL's compare-and-set) treats
-- it like any other: a replace stores the new envelope unpaused. Resuming puts it
-- back in the index at the due time the caller computed: a one-shot at its own due
-- (past due: it fires at once), a recurring one at its first occurrence after the
-- resume (the fires it missed are skipped, not caught up).
-- Atomic against FIRE (one node) and CLAIM (Cluster): the entry is either still in
-- the index (paused here, never fired) or already taken (fired, or in flight: 'busy').
local STREAM, INDEX_TOP, IDS, BUCKET_SEQ, PENDING, HISTORY, PARKED, CALLS, REFILL_SET, OUTBOX =
  KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6], KEYS[7], KEYS[8], KEYS[9], KEYS[10]
-- In-flight and claims: passed on Redis Cluster only (13 keys); nil otherwise.
local INFLIGHT, CLAIMS
if #KEYS >= 13 then INFLIGHT, CLAIMS = KEYS[11], KEYS[12] end
local MOVED = KEYS[#KEYS]
local BUCKET_PREFIX, NOW_MS, HIST_LEN, OP, ID, REASON, WAKE_CHANNEL, READ_REF, AT_MS, NEXT_MS, NEXT_ISO =
  ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6], ARGV[7], ARGV[8], ARGV[9], ARGV[10], ARGV[11]
--!include index.lua
--!include decode.lua
--!include history.lua
--!include common.lua

HIST_MAXLEN, HIST_NOW = tonumber(HIST_LEN), NOW_MS
local op, key, reason = OP, ID, REASON
local claims = nil
if #KEYS >= 13 then claims = CLAIMS end

local ref = redis.call('HGET', IDS, key)
if not ref then return {'unknown', ''} end
local sid, due, _, _, flag = parse_ref(ref)
if redis.call('HEXISTS', PARKED, sid) == 1 then return {'parked', ''} end
if claims and redis.call('HEXISTS', claims, sid) == 1 then return {'busy', ''} end
local env = read_envelope(sid)

local function record(event, at_due)
  if env then
    hist(event, key, env.sid, env.topic, env.kind, at_due, '', env.size, math.max(env.attempt, 1), reason, env.schedule)
  else
    hist(event, key, '', '', 0, at_due, '', '', 1, reason, '')
  end
end

local topic = env and env.topic or ''
if op == 'pause' then
  if flag == 'p' then return {'already', topic} end
  -- 'u': a cron envelope waiting for REFILL is in the refill set, not in the index.
  if flag ~= 'u' and tonumber(due) then remove(sid, due) end
  redis.call('ZREM', REFILL_SET, key)
  redis.call('HSET', IDS, key, make_ref(sid, due, '-', HIST_NOW, 'p'))
  record('paused', due)
  return {'paused', topic}
end

-- resume
if flag ~= 'p' then return {'already', topic} end
if ref ~= READ_REF then return {'stale', topic} end
local at, nxt, iso = AT_MS, NEXT_MS, NEXT_ISO
local before = head()
insert(sid, at)
redis.call('HSET', IDS, key, make_ref(sid, at, nxt, iso, 'i'))
record('resumed', at)
if before == nil or tonumber(before) > tonumber(at) then
  redis.call('PUBLISH', WAKE_CHANNEL, at)
end
return {'resumed', topic}
