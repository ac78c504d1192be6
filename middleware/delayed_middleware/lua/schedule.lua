-- SCHEDULE: store envelopes durably and index them by due time.
-- KEYS: 1 delayed stream, 2 index top, 3 ids hash, 4 bucket seq, 5 pending count,
--       6 history, 7 parked, 8 call tokens, 9 refill, 10 outbox; on Redis Cluster's
--       two-phase fire also 11 in-flight zset, 12 claims hash (claim.lua); the last
--       key is the moved hash (moved.lua): 11 on a single node, 13 on Cluster
-- ARGV: 1 bucket key prefix, 2 wake channel, 3 now ms (history), 4 call token ('' = none),
--       5 history maxlen (0 = off), 6 token window ms, 7 n, then n groups of 9:
--       envelope bytes, due ms, scheduleId, kind (0 one-shot, 1 recurring, 2 retry),
--       topic, size, schedule expression, next due ms ('-' none, 'purge'), next RFC3339 ('-')
-- Returns the envelope ids in order (the scheduleId, else for a recurring
-- envelope or one without id its stream id), or {'dup'} when this call token
-- was applied before: a client retrying after a lost reply stores nothing twice.
-- With KEYS[11..12], the ids are followed by three values per replaced envelope
-- whose occurrence is in flight (claimed, maybe not yet appended): its envelope
-- id, the claimed due ms and the key APPEND writes; the caller sets that
-- occurrence's fire marker so the claiming replica's APPEND writes nothing.
-- A scheduleId already pending is replaced: its old envelope leaves the index
-- and the stream in the same step. The wake channel is told when a new
-- envelope became the earliest, so sleeping replicas shorten their sleep.
local STREAM, INDEX_TOP, IDS, BUCKET_SEQ, PENDING, HISTORY, PARKED, CALLS, REFILL_SET, OUTBOX =
  KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6], KEYS[7], KEYS[8], KEYS[9], KEYS[10]
-- In-flight and claims: passed on Redis Cluster only (13 keys); nil otherwise.
local INFLIGHT, CLAIMS
if #KEYS >= 13 then INFLIGHT, CLAIMS = KEYS[11], KEYS[12] end
local MOVED = KEYS[#KEYS]
local BUCKET_PREFIX, WAKE_CHANNEL, NOW_MS, CALL_TOKEN, HIST_LEN, TOKEN_WINDOW_MS, N_ENVELOPES =
  ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6], ARGV[7]
--!include index.lua
--!include decode.lua
--!include history.lua
--!include common.lua
HIST_MAXLEN, HIST_NOW = tonumber(HIST_LEN), NOW_MS
local token = CALL_TOKEN
if token ~= '' then
  if redis.call('ZSCORE', CALLS, token) then return {'dup'} end
  -- Tokens age by the Redis clock, the one clock every replica shares: a
  -- replica whose clock runs ahead must not forget the others' tokens.
  local t = redis.call('TIME')
  local server_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  -- Forget tokens older than the window, a bounded number per call.
  local old = redis.call('ZCOUNT', CALLS, '-inf', server_ms - tonumber(TOKEN_WINDOW_MS))
  if old > 0 then redis.call('ZREMRANGEBYRANK', CALLS, 0, math.min(old, 100) - 1) end
  redis.call('ZADD', CALLS, server_ms, token)
end
local before = head()
local ids, earliest = {}, nil
local inflight = {}
for i = 0, tonumber(N_ENVELOPES) - 1 do
  local base = 8 + i * 9
  local env, due, sid, kind = ARGV[base], ARGV[base + 1], ARGV[base + 2], tonumber(ARGV[base + 3])
  local topic, size, expr = ARGV[base + 4], ARGV[base + 5], ARGV[base + 6]
  local nxt, iso = ARGV[base + 7], ARGV[base + 8]
  if sid ~= '' then
    local old = redis.call('HGET', IDS, sid)
    if old then
      local claimed = CLAIMS and redis.call('HGET', CLAIMS, (parse_ref(old)))
      if claimed then
        local e = read_envelope((parse_ref(old)))
        if e then
          local key = OUTBOX
          if e.target == '' then key = e.topic end
          for _, v in ipairs({(parse_ref(old)), string.match(claimed, '^(%S+)'), key}) do
            inflight[#inflight + 1] = v
          end
        end
      end
      local old_id, old_due = drop_ref(sid, old)
      hist('replaced', sid, sid, topic, kind, old_due or '', '', '', 1, old_id, expr)
    end
  end
  local id = redis.call('XADD', STREAM, '*', 'data', env, 'metadata', '{}')
  insert(id, due)
  local key = sid
  if key == '' and kind == 1 then key = id end
  if key ~= '' then redis.call('HSET', IDS, key, make_ref(id, due, nxt, iso, 'i')) end
  if key == '' then key = id end
  hist('scheduled', key, sid, topic, kind, due, '', size, 1, '', expr)
  ids[#ids + 1] = key
  if earliest == nil or tonumber(due) < earliest then earliest = tonumber(due) end
end
if earliest ~= nil and (before == nil or tonumber(before) > earliest) then
  redis.call('PUBLISH', WAKE_CHANNEL, tostring(earliest))
end
for _, v in ipairs(inflight) do ids[#ids + 1] = v end
return ids
