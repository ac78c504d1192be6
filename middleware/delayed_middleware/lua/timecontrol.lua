-- TIMECONTROL: trigger now, or reschedule, one pending message or schedule (scheduleTrigger,
-- scheduleReschedule; engine/timecontrol.py).
-- KEYS: 1 delayed stream, 2 index top, 3 ids hash, 4 bucket seq, 5 pending count,
--       6 history, 7 parked, 8 call tokens, 9 refill, 10 outbox; on Redis Cluster's
--       two-phase fire also 11 in-flight zset, 12 claims hash; the last key is the
--       moved hash (moved.lua): 11 on a single node, 13 on Cluster
-- ARGV: 1 bucket key prefix, 2 now ms ('' = the Redis server's TIME, as FIRE's),
--       3 history maxlen, 4 'trigger' | 'reschedule', 5 the id (scheduleId, or a
--       recurring envelope's id without one), 6 reason (history), 7 wake channel,
--       8 the firing component's name ('' = any: as FIRE's trim rule),
--       9 the occurrence metadata key (stamped on a triggered extra occurrence),
--       10 with 'reschedule': the new due ms; with 'record': the trigger's time (ms); else '',
--       11 trim mode, 12 trim threshold (as FIRE's ARGV[6..7]), 13 '1': a single node's
--       fire path, whose extra occurrence is appended here, trimmed as a fire's ('0': the
--       two-phase path's 'extra'), 14 with 'trigger' and 'record': the request's identity
--       ('' = none: every call is a new trigger), 15 the token window ms (identities older
--       than it are forgotten, a bounded number per call, as SCHEDULE forgets its tokens),
--       16 with 'trigger' on the two-phase path: the extra occurrence's token (its fire marker
--       ends in `t<now ms>:<token>`; with a request, derived from it: a retry sends the same),
--       17 how long (ms, Redis clock) a registration is kept
-- Returns {status, topic, now ms, ...}: status
--   'moved'      a one-shot: trigger put it in the due index at now (the fire step
--                delivers it, exactly once, as any due message); reschedule at ARGV[10]
--   'appended'   trigger of a recurring schedule, ARGV[13] '1' (a single node): its extra occurrence
--                went out here (target_append.lua, as FIRE appends) with its `triggered`
--                record, in this one atomic step; the schedule itself is unchanged
--   'failed'     the same, not delivered: followed by why (bad target, XADD refused)
--   'extra'      the same, ARGV[13] '0': Redis Cluster's two-phase fire (the target is
--                in another slot): followed by one claim record in
--                CLAIM's format (claim.lua: 13 values, then (data, metadata, contentType)
--                triples), which the caller APPENDs; the schedule itself is unchanged.
--                The occurrence is registered in the triggers set (below) until then
--   'unknown'    nothing pending under that id
--   'fired'      nothing pending, and its newest history record is `fired`: it went out
--   'busy'       Cluster: an occurrence is in flight (CLAIM..RELEASE); the caller retries
--   'parked'     held for a bad target
--   'expired'    its TTL ended: the fire step drops it, it is not delivered
--   'recurring'  reschedule of a recurring schedule (refused: publish it again)
--   'again'      trigger: this request (ARGV[14]) was carried out before: its answer again
--                (on Cluster, 'extra' again while it is registered but not recorded: see below)
--   'recorded'   'record': the `triggered` history record of an extra occurrence, written
--                by the caller once its APPEND went out (never for one that did not); once
--                per request (both attempts of one request may have seen it go out)
--
-- Exactly once: a one-shot moves inside the due index, in one atomic step
-- against FIRE and CLAIM: either they took it first (it fired: 'fired' or 'busy')
-- or it waits at its new time and fires there once. A trigger never appends a
-- one-shot itself, so a trigger racing its own fire cannot deliver it twice.
-- A paused one-shot: reschedule keeps it paused at its new due (resume puts it
-- back there); trigger delivers it (it is a one-shot: delivered once and gone).
-- A recurring schedule's extra occurrence: on a single node its messages are
-- appended here, so a cancel is answered either before (nothing goes out) or
-- after (it went out); on Cluster it is one APPEND by the caller (its own fire
-- marker), and this script registers it in the triggers set (`<claims>-triggers`,
-- a sorted set beside the claims hash: member `<envelope id> t<now>:<token>`,
-- score its Redis time), where CANCEL finds it as it finds a claimed occurrence:
-- a cancel answered between the two sets that marker first, and the APPEND
-- writes nothing. The caller removes the registration once its APPEND is settled;
-- one left by a crash is swept here after ARGV[17] ms (and the set expires when
-- no trigger comes). Either way the schedule keeps its ref, index entry and pause,
-- so its next occurrence stays where it was.
local STREAM, INDEX_TOP, IDS, BUCKET_SEQ, PENDING, HISTORY, PARKED, CALLS, REFILL_SET, OUTBOX =
  KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6], KEYS[7], KEYS[8], KEYS[9], KEYS[10]
local CLAIMS, TRIGGERS
if #KEYS >= 13 then CLAIMS = KEYS[12] end
-- The triggers set: derived from the claims hash's name, in its slot (keys.EngineKeys.triggers).
if CLAIMS then TRIGGERS = CLAIMS .. '-triggers' end
local MOVED = KEYS[#KEYS]
local BUCKET_PREFIX, NOW_ARG, HIST_LEN, OP, ID, REASON, WAKE_CHANNEL, OWN_PUBSUB, OCCURRENCE_KEY, NEW_DUE =
  ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6], ARGV[7], ARGV[8], ARGV[9], ARGV[10]
--!include index.lua
--!include decode.lua
--!include history.lua
--!include common.lua
--!include batch.lua

local now = decision_now(NOW_ARG)
-- The locals target_append.lua expects, as FIRE sets them.
local trim_mode, trim_at = ARGV[11] or '', ARGV[12] or ''
if trim_mode == 'MINAGE' then trim_mode, trim_at = 'MINID', string.format('%.0f-1', now - tonumber(trim_at)) end
local own_pubsub = OWN_PUBSUB or ''
--!include target_append.lua
local now_s = string.format('%.0f', now)
HIST_MAXLEN, HIST_NOW = tonumber(HIST_LEN), now_s
local key = ID

-- A trigger request's identity (a CloudEvent id: stable across daprd's retries of one
-- publish), kept in CALLS beside SCHEDULE's call tokens and forgotten with them (by
-- SCHEDULE, after its token window): a retry after a lost answer is answered as the
-- first, and delivers nothing more. Scored by the Redis clock, as SCHEDULE's tokens.
-- The id's length comes first: ids and requests may hold ':', and `a:b` + `c` must not be
-- `a` + `b:c` (that trigger was answered OK and delivered nothing).
local request = ''
if (OP == 'trigger' or OP == 'record') and (ARGV[14] or '') ~= '' then
  request = 'trigger:' .. #key .. ':' .. key .. ':' .. ARGV[14]
end
if request ~= '' and OP == 'trigger' and redis.call('ZSCORE', CALLS, request) then return {'again', '', now_s} end
-- Cluster: the request's identity is recorded after its APPEND ('record'), but its extra
-- occurrence is decided here, and registered (below) under the request's own token. A retry
-- that finds that registration (within the token window, Redis clock) while the first attempt
-- has not recorded is the same trigger: it gets the same claim back (same token, same trigger
-- time, so the same fire marker), and of the two APPENDs under that marker one writes (SET NX).
-- Per envelope: a registration of an envelope replaced since (same id, same request, so the
-- same token) must not hide the current one's.
local first_at, first_of = nil, {}
if request ~= '' and OP == 'trigger' and TRIGGERS and (ARGV[16] or '') ~= '' then
  local window = tonumber(ARGV[15] or '0') or 0
  local from = '-inf'
  if window > 0 then from = string.format('%.0f', decision_now('') - window) end
  local tail = ':' .. ARGV[16]
  for _, m in ipairs(redis.call('ZRANGEBYSCORE', TRIGGERS, from, '+inf')) do
    if string.sub(m, -#tail) == tail then
      local of, at = string.match(m, '^(%S+) t(%d+):')
      if of and not first_of[of] then first_of[of] = at end
    end
  end
end
local function answered(reply)
  if request ~= '' then
    local server_ms = decision_now('')
    redis.call('ZADD', CALLS, 'NX', string.format('%.0f', server_ms), request)
    -- An app that triggers often and schedules seldom must not grow CALLS for good.
    local window = tonumber(ARGV[15] or '0') or 0
    if window > 0 then forget_tokens(CALLS, server_ms, window, 100) end
  end
  return reply
end

-- Nothing pending under `key`: 'fired' when its newest record says it went out.
local function absent()
  local newest = redis.call('HGET', HISTORY .. '-ids', key)
  if newest then
    local rows = redis.call('XRANGE', HISTORY, newest, newest)
    local f = rows[1] and rows[1][2] or {}
    for j = 1, #f, 2 do
      if f[j] == 'event' and f[j + 1] == 'fired' then return {'fired', '', now_s} end
    end
  end
  return {'unknown', '', now_s}
end

if OP == 'record' then
  -- An extra occurrence went out: its record, at the trigger's time. Written after the APPEND,
  -- so a crash before it leaves no `triggered` without a delivery (the caller's retry is the one).
  HIST_NOW = NEW_DUE
  -- A retry that appended under the first attempt's marker records once, as the first does.
  if request ~= '' and redis.call('ZSCORE', CALLS, request) then return {'recorded', '', now_s} end
  local r = redis.call('HGET', IDS, key)
  local e = r and read_envelope((parse_ref(r)))
  if e then
    hist('triggered', key, e.sid, e.topic, e.kind, NEW_DUE, '', e.size, math.max(e.attempt, 1), REASON, e.schedule)
  else
    -- Cancelled or replaced after its APPEND went out (or a replace meanwhile): the record all the same.
    hist('triggered', key, '', '', 1, NEW_DUE, '', '', 1, REASON, '')
  end
  return answered({'recorded', '', now_s})
end

local ref = redis.call('HGET', IDS, key)
if not ref then return absent() end
local sid, due, nxt, iso, flag = parse_ref(ref)
if redis.call('HEXISTS', PARKED, sid) == 1 then return {'parked', '', now_s} end
local env = read_envelope(sid)
if not env then return {'unknown', '', now_s} end
local topic = env.topic
local attempt = math.max(env.attempt, 1)
if CLAIMS and redis.call('HEXISTS', CLAIMS, sid) == 1 then
  -- In flight: a one-shot is being delivered (it fired); a recurring one is
  -- mid-occurrence and its ref changes at RELEASE: the caller retries after it.
  if env.kind ~= 1 and OP == 'reschedule' then return {'fired', topic, now_s} end
  return {'busy', topic, now_s}
end
-- The first attempt's decision (above), for this envelope: its trigger time, not expired since.
first_at = first_of[sid]
if first_at then
  now, now_s = tonumber(first_at), first_at
elseif env.expires > 0 and env.expires <= now then
  return {'expired', topic, now_s}
end

-- Moves a one-shot's index entry from its due to `at` (a paused one stays out of the index).
local function move(at)
  local before = head()
  if flag == 'i' and tonumber(due) then remove(sid, due) end
  if flag == 'p' then
    redis.call('HSET', IDS, key, make_ref(sid, at, nxt, iso, 'p'))
  else
    insert(sid, at)
    redis.call('HSET', IDS, key, make_ref(sid, at, nxt, iso, 'i'))
    if before == nil or tonumber(before) > tonumber(at) then redis.call('PUBLISH', WAKE_CHANNEL, at) end
  end
end

if OP == 'reschedule' then
  if env.kind == 1 then return {'recurring', topic, now_s} end
  -- A past time is now, as a past scheduledSendTime (one before 1970 had no scheduleOccurrence).
  if tonumber(NEW_DUE) < now then NEW_DUE = now_s end
  move(NEW_DUE)
  local from = tonumber(due) and iso_ms(tonumber(due)) or due
  hist('rescheduled', key, env.sid, topic, env.kind, NEW_DUE, '', env.size, attempt, REASON .. ' from ' .. from, env.schedule)
  return {'moved', topic, now_s}
end

-- trigger
if env.kind ~= 1 then
  -- Delivered once and gone: a paused one-shot (out of the index) goes back in, unpaused.
  if flag == 'p' then flag, iso = 'x', '-' end
  move(now_s)
  hist('triggered', key, env.sid, topic, env.kind, now_s, '', env.size, attempt, REASON, env.schedule)
  return answered({'moved', topic, now_s})
end

-- A recurring schedule: one extra occurrence, its messages as a fire stamps them.
-- scheduleNext: its pending occurrence ('-' while paused: none is scheduled).
local next_iso = '-'
if flag ~= 'p' and tonumber(due) then next_iso = iso_ms(tonumber(due)) end
local target = OUTBOX
if env.target == '' then target = topic end
local expires = env.expires
if env.sttl > 0 then expires = now + env.sttl end
local entries = env.entries
if env.source ~= '' then entries = {} end
local own = OWN_PUBSUB or ''
local trim = (env.target == '' and (own == '' or env.pubsub == own)) and 1 or 0
local occurrence = iso_ms(now)
if ARGV[13] == '1' then
  -- A single node: appended here, as FIRE appends an occurrence (same checks, stamps, trim).
  local target, bad = OUTBOX, nil
  if env.target == '' then
    target = topic
    bad = bad_target(target)
  end
  if bad then return {'failed', topic, now_s, bad} end
  local done, failed = append(env, key, next_iso, occurrence, target)
  if failed and done == 0 then return {'failed', topic, now_s, failed} end
  hist('triggered', key, env.sid, topic, env.kind, now_s, '', env.size, attempt, REASON, env.schedule)
  return answered({'appended', topic, now_s})
end
local out = {'extra', topic, now_s, sid, now_s, key, next_iso, occurrence, target, env.target, topic,
  env.bulk and 1 or 0, expires, env.source, trim, #entries}
for _, e in ipairs(entries) do
  local md = e[2]
  md['scheduler'] = key
  md['scheduleNext'] = next_iso
  md[OCCURRENCE_KEY] = occurrence
  local ok, json = pcall(cjson.encode, md)
  if not ok then return {'parked', topic, now_s} end
  out[#out + 1] = e[1]
  out[#out + 1] = json
  out[#out + 1] = e[3]
end
if TRIGGERS and (ARGV[16] or '') ~= '' then
  -- Registered for CANCEL (see above); older registrations (a caller that died) are swept.
  local keep = tonumber(ARGV[17] or '') or 0
  local server_ms = decision_now('')
  if keep > 0 then
    redis.call('ZREMRANGEBYSCORE', TRIGGERS, '-inf', string.format('(%.0f', server_ms - keep))
  end
  redis.call('ZADD', TRIGGERS, string.format('%.0f', server_ms), sid .. ' t' .. now_s .. ':' .. ARGV[16])
  if keep > 0 then redis.call('PEXPIRE', TRIGGERS, string.format('%.0f', keep)) end
end
return out
