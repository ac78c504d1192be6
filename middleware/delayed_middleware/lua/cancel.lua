-- CANCEL: withdraw pending messages or schedules; nothing more is delivered.
-- KEYS: 1 delayed stream, 2 index top, 3 ids hash, 4 bucket seq, 5 pending count,
--       6 history, 7 parked, 8 call tokens, 9 refill, 10 outbox; on Redis Cluster's
--       two-phase fire also 11 in-flight zset, 12 claims hash (claim.lua); the last
--       key is the moved hash (moved.lua): 11 on a single node, 13 on Cluster
-- ARGV: 1 bucket key prefix, 2 now ms, 3 history maxlen, 4 reason, 5 n, then n ids
--       (each a scheduleId, or an envelope's stream id on the delayed topic)
-- Returns two values per id: 1 when something pending (or parked) was cancelled,
-- else 0; and the cancelled message's topic ('' when unknown), for markers.
-- Then, with KEYS[11..12], six values per cancelled envelope whose occurrence
-- is in flight (claimed, maybe not yet appended): the id's position (1-based),
-- envelope id, occurrence due ms (as claimed), the key APPEND writes (topic or
-- outbox), kind, and the entry id of its `cancelled` history record ('' none). The caller sets that occurrence's fire marker (NX, in the
-- target's slot): an APPEND after it writes nothing; if APPEND set it first,
-- the occurrence went out before this cancel. A recurring schedule's extra
-- occurrence that a trigger decided but has not settled (TIMECONTROL's triggers
-- set) is named the same way, its due being `t<trigger ms>:<token>` (the end of
-- its marker); this removes its registration.
-- Bounded: the caller sends at most a few hundred ids per call.
--
-- Cost: a bulk of cancels is the common case (100k in a few seconds), so an id
-- found in the ids hash costs what its history record needs (one XRANGE, a
-- peek at the envelope's few small fields, one XADD) and its removals (index,
-- stream, ids, refill and parked marks) are queued and applied together, a
-- few commands per call instead of ~10 per id. The script is atomic, so the
-- order of its writes is invisible; within the call, `done` and `gone` make
-- an id (or an envelope reached by two ids) count once.
local STREAM, INDEX_TOP, IDS, BUCKET_SEQ, PENDING, HISTORY, PARKED, CALLS, REFILL_SET, OUTBOX =
  KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6], KEYS[7], KEYS[8], KEYS[9], KEYS[10]
-- In-flight and claims: passed on Redis Cluster only (13 keys); nil otherwise.
local INFLIGHT, CLAIMS, TRIGGERS
if #KEYS >= 13 then INFLIGHT, CLAIMS = KEYS[11], KEYS[12] end
-- TIMECONTROL's triggers set, beside the claims hash (keys.EngineKeys.triggers).
if CLAIMS then TRIGGERS = CLAIMS .. '-triggers' end
local MOVED = KEYS[#KEYS]
local BUCKET_PREFIX, NOW_MS, HIST_LEN, REASON, N_IDS =
  ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5]
--!include index.lua
--!include decode.lua
--!include history.lua
--!include common.lua

-- The length of the `event` (field 2) of the DelayedBulkEntry in s[from..to].
local function event_length(s, from, to)
  local event = 0
  each_field(s, from, to, function(fno, b, e)
    if fno == 2 then event = b and e - b + 1 or 0 end
  end)
  return event
end

-- peek(s) returns what a cancel needs of an envelope (its history record and,
-- on Cluster, where APPEND would write it): topic, scheduleId, kind, schedule,
-- size and targetPubsub, as decode() reads them, without copying its body or
-- decoding its metadata (decode() costs ~7 us for a small envelope, this ~2).
-- Raises where decode() would on its top level and on a bulk body's framing,
-- not inside the metadata maps it skips. It shares decode()'s walk (message(),
-- in spans mode), so the two cannot read an envelope differently.
local function peek(s)
  -- As decode(): the last occurrence of a field wins, and a field of the
  -- wrong wire type reads as empty (or 0).
  local at, num, _, _, last = message(s, 1, #s, true)
  local function bytes(n) return at[n] and sub(s, at[n], last[n]) or '' end
  local topic, sid, schedule, target = bytes(1), bytes(10), bytes(12), bytes(16)
  local bulk, kind = num[5] or 0, num[11] or 0
  local body_from, body_to = at[2], last[2]
  if topic == '' then error('no topic') end
  local size = 0
  if body_from and bulk == 0 then
    size = body_to - body_from + 1
  elseif body_from then
    -- A DelayedBulk: the sum of its entries' event lengths.
    each_field(s, body_from, body_to, function(fno, b, e)
      if fno == 1 and b then size = size + event_length(s, b, e) end
    end)
  end
  return topic, sid, kind, schedule, size, target
end

-- The history fields of the envelope at stream id `id` (see peek), or nil
-- (gone or undecodable).
local function peek_envelope(id)
  local at = stored_at(id)
  local e = redis.call('XRANGE', STREAM, at, at)[1]
  if not e then return nil end
  local f = e[2]
  for j = 1, #f, 2 do
    if f[j] == 'data' then
      local ok, topic, sid, kind, schedule, size, target = pcall(peek, f[j + 1])
      if ok then return topic, sid, kind, schedule, size, target end
      return nil
    end
  end
  return nil
end

-- Removals queued by cancel_ref, applied by flush().
local taken, xdels, keys, sids = {}, {}, {}, {}
local located = {}
local done, gone = {}, {}
-- Cancelled envelopes whose occurrence is in flight (see the reply).
local inflight = {}

-- Notes envelope `id` (cancelled as the pos-th id) if the two-phase fire has
-- claimed an occurrence of it. `target` = its targetPubsub ('' = our topic).
-- Registered triggers (TIMECONTROL), envelope id -> its members: read once per call, and
-- only for a recurring envelope (only a schedule's trigger registers): a bulk of one-shot
-- cancels never reads the set, whose size is the triggers unsettled or left by errors.
local triggered = nil
local function triggers_of(id)
  if triggered == nil then
    triggered = {}
    for _, m in ipairs(redis.call('ZRANGE', TRIGGERS, 0, -1)) do
      local of = string.match(m, '^(%S+) ')
      if of then
        triggered[of] = triggered[of] or {}
        table.insert(triggered[of], m)
      end
    end
  end
  local marks = triggered[id]
  triggered[id] = nil
  return marks or {}
end

local function note_inflight(pos, id, topic, target, kind, hid)
  if not CLAIMS or topic == '' then return end
  local key = OUTBOX
  if target == '' then key = topic end
  local dues = {}
  local rec = redis.call('HGET', CLAIMS, id)
  if rec then dues[1] = string.match(rec, '^(%S+)') end
  for _, m in ipairs(kind == 1 and triggers_of(id) or {}) do
    dues[#dues + 1] = string.match(m, ' (%S+)$')
    redis.call('ZREM', TRIGGERS, m)
  end
  for _, due in ipairs(dues) do
    for _, v in ipairs({pos, id, due, key, kind, hid or ''}) do inflight[#inflight + 1] = v end
  end
end

local function flush()
  remove_candidates(taken)
  delete_envelopes(xdels)
  for _, q in ipairs({{'HDEL', IDS, keys}, {'ZREM', REFILL_SET, keys},
                      {'HDEL', PARKED, sids}}) do
    local list = q[3]
    for i = 1, #list, 500 do
      redis.call(q[1], q[2], unpack(list, i, math.min(i + 499, #list)))
    end
  end
  -- Index removals changed the buckets: locate afresh.
  taken, xdels, keys, sids, located = {}, {}, {}, {}, {}
end

-- An id the ids hash knows (ref = its value): as drop_ref, queued.
local function cancel_ref(pos, key, ref)
  -- parse_ref's result, by one pattern for the current 5-part form.
  local sid, due, flag = string.match(ref, '^(%S+) (%S+) %S+ %S+ (%S+)$')
  if not sid then
    local _
    sid, due, _, _, flag = parse_ref(ref)
  end
  if gone[sid] then return 0, '' end
  gone[sid] = true
  local topic, esid, kind, schedule, size, target = peek_envelope(sid)
  -- A ref without a numeric due (written by hand) names no index entry; locating
  -- it would raise, after this call's earlier history records.
  if flag ~= 'u' and tonumber(due) then
    local b = located[due]
    if b == nil then
      b = locate(due) or false
      located[due] = b
    end
    if b then taken[#taken + 1] = {sid, due, b} end
  end
  xdels[#xdels + 1] = sid
  keys[#keys + 1] = key
  sids[#sids + 1] = sid
  if topic then
    local hid = hist('cancelled', key, esid, topic, kind, due or '', '', size, 1, REASON, schedule)
    note_inflight(pos, sid, topic, target, kind, hid)
    return 1, topic
  end
  hist('cancelled', key, '', '', 0, due or '', '', '', 1, REASON, '')
  return 1, ''
end

-- An envelope's stream id (one without scheduleId, or a recurring one's):
-- rare, so done on the spot, after what is queued.
local function cancel_stream_id(pos, key)
  if gone[key] then return 0, '' end
  -- Not an id in the hash: maybe a stream id of an envelope without scheduleId.
  if not string.match(key, '^%d+%-%d+$') then return 0, '' end
  -- Digits beyond a stream id's 64-bit parts: XRANGE would refuse it, and an
  -- id that cannot exist names nothing pending.
  local ok, rows = pcall(redis.call, 'XRANGE', STREAM, key, key, 'COUNT', 1)
  if not ok then return 0, '' end
  -- A copy compaction made (a subscriber of the delayed topic sees it under
  -- this id): the message is the envelope it holds, named by its first id,
  -- the id the index and the moved hash know. Only the copy the moved hash
  -- points at is that envelope (compact.lua).
  local f = rows[1] and rows[1][2] or {}
  for j = 1, #f, 2 do
    if f[j] == 'origin' and redis.call('HGET', MOVED, f[j + 1]) == key then key = f[j + 1] end
  end
  if gone[key] or done[key] then return 0, '' end
  -- A recurring envelope without scheduleId is known by that first id in the ids hash.
  local ref = redis.call('HGET', IDS, key)
  if ref then
    done[key] = true
    return cancel_ref(pos, key, ref)
  end
  flush()
  local sid, due = key, nil
  local env = read_envelope(sid)
  if delete_envelopes({sid}) == 0 then return 0, '' end
  gone[sid] = true
  if env then
    due = env.due
    local r = env.sid ~= '' and redis.call('HGET', IDS, env.sid)
    if r and parse_ref(r) == sid then
      -- Its ref knows where it waits now: a recurring envelope moves on after
      -- each fire (or waits for REFILL outside the index).
      local _, rdue, _, _, flag = parse_ref(r)
      due = rdue
      if flag ~= 'u' and tonumber(rdue) then remove(sid, rdue) end
      redis.call('HDEL', IDS, env.sid)
      redis.call('ZREM', REFILL_SET, env.sid)
      done[env.sid] = true
    else
      remove(sid, due)
    end
  end
  redis.call('HDEL', PARKED, sid)
  if env then
    local hid = hist('cancelled', key, env.sid, env.topic, env.kind, due or '', '', env.size, 1, REASON, env.schedule)
    note_inflight(pos, sid, env.topic, env.target, env.kind, hid)
    return 1, env.topic
  end
  hist('cancelled', key, '', '', 0, due or '', '', '', 1, REASON, '')
  return 1, ''
end

HIST_MAXLEN, HIST_NOW = tonumber(HIST_LEN), NOW_MS
local n = tonumber(N_IDS)
local out = {}
for from = 1, n, 500 do
  local to = math.min(from + 499, n)
  local refs = redis.call('HMGET', IDS, unpack(ARGV, 5 + from, 5 + to))
  for i = from, to do
    local key = ARGV[5 + i]
    local ref = refs[i - from + 1]
    local found, topic = 0, ''
    if done[key] then
      found = 0
    elseif ref then
      done[key] = true
      found, topic = cancel_ref(i, key, ref)
    else
      found, topic = cancel_stream_id(i, key)
    end
    out[#out + 1] = found
    out[#out + 1] = topic
  end
end
flush()
for _, v in ipairs(inflight) do out[#out + 1] = v end
return out
