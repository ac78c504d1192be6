-- SCHEDULE: store the envelopes of one or more calls durably and index them by due time.
-- KEYS: 1 delayed stream, 2 index top, 3 ids hash, 4 bucket seq, 5 pending count,
--       6 history, 7 parked, 8 call tokens, 9 refill, 10 outbox; on Redis Cluster's
--       two-phase fire also 11 in-flight zset, 12 claims hash (claim.lua); the last
--       key is the moved hash (moved.lua): 11 on a single node, 13 on Cluster
-- ARGV: 1 bucket key prefix, 2 wake channel, 3 now ms (history), 4 history maxlen (0 = off),
--       5 token window ms, 6 g calls, then g groups, each: call token ('' = none), n, then
--       n groups of 9: envelope bytes, due ms, scheduleId, kind (0 one-shot, 1 recurring,
--       2 retry), topic, size, schedule expression, next due ms ('-' none, 'purge'),
--       next RFC3339 ('-')
-- Concurrent publishes are coalesced into one call of this script (engine/schedule.py),
-- each keeping its own token and its own answer. The calls are applied in order, so of
-- two calls replacing one scheduleId the later one wins, as it would sequentially.
-- Returns, per call in order: a status ('ok', 'dup' or 'err'), a count m, then m values.
-- 'ok': the envelope ids in order (the scheduleId, else for a recurring envelope or one
-- without id its stream id); with KEYS[11..12] followed by three values per replaced
-- envelope whose occurrence is in flight (claimed, maybe not yet appended): its envelope
-- id, the claimed due ms and the key APPEND writes; the caller sets that occurrence's
-- fire marker so the claiming replica's APPEND writes nothing.
-- 'dup' (m = 0): this call token was applied before: a client retrying after a lost
-- reply stores nothing twice. 'err' (m = 1): the error that stopped this call; the
-- other calls are stored all the same. The token is recorded only once a call's
-- envelopes are all written, so a call that failed part way is never taken for done.
-- A scheduleId already pending is replaced: its old envelope leaves the index
-- and the stream in the same step. The wake channel is told when a new
-- envelope became the earliest, so sleeping replicas shorten their sleep.
local STREAM, INDEX_TOP, IDS, BUCKET_SEQ, PENDING, HISTORY, PARKED, CALLS, REFILL_SET, OUTBOX =
  KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6], KEYS[7], KEYS[8], KEYS[9], KEYS[10]
-- In-flight and claims: passed on Redis Cluster only (13 keys); nil otherwise.
local INFLIGHT, CLAIMS
if #KEYS >= 13 then INFLIGHT, CLAIMS = KEYS[11], KEYS[12] end
local MOVED = KEYS[#KEYS]
local BUCKET_PREFIX, WAKE_CHANNEL, NOW_MS, HIST_LEN, TOKEN_WINDOW_MS, N_CALLS =
  ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5], tonumber(ARGV[6])
--!include index.lua
--!include decode.lua
--!include history.lua
--!include common.lua
HIST_MAXLEN, HIST_NOW = tonumber(HIST_LEN), NOW_MS
-- Tokens age by the Redis clock, the one clock every replica shares: a
-- replica whose clock runs ahead must not forget the others' tokens.
local server_ms = decision_now('')
forget_tokens(CALLS, server_ms, tonumber(TOKEN_WINDOW_MS), 100 + 2 * N_CALLS)
local before = head()
local earliest = nil

-- One call's envelopes from ARGV[base]; appends its ids and in-flight triples to `out`.
local function store(base, n, out)
  local inflight = {}
  for i = 0, n - 1 do
    local b = base + i * 9
    local env, due, sid, kind = ARGV[b], ARGV[b + 1], ARGV[b + 2], tonumber(ARGV[b + 3])
    local topic, size, expr = ARGV[b + 4], ARGV[b + 5], ARGV[b + 6]
    local nxt, iso = ARGV[b + 7], ARGV[b + 8]
    if sid ~= '' then
      local old_ref = redis.call('HGET', IDS, sid)
      if old_ref then
        local claimed = CLAIMS and redis.call('HGET', CLAIMS, (parse_ref(old_ref)))
        if claimed then
          local e = read_envelope((parse_ref(old_ref)))
          if e then
            local key = OUTBOX
            if e.target == '' then key = e.topic end
            for _, v in ipairs({(parse_ref(old_ref)), string.match(claimed, '^(%S+)'), key}) do
              inflight[#inflight + 1] = v
            end
          end
        end
        local old_id, old_due = drop_ref(sid, old_ref)
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
    out[#out + 1] = key
    if earliest == nil or tonumber(due) < earliest then earliest = tonumber(due) end
  end
  for _, v in ipairs(inflight) do out[#out + 1] = v end
end

local reply = {}
local at = 7
for _ = 1, N_CALLS do
  local token, n = ARGV[at], tonumber(ARGV[at + 1])
  if token ~= '' and redis.call('ZSCORE', CALLS, token) then
    reply[#reply + 1] = 'dup'
    reply[#reply + 1] = 0
  else
    local out = {}
    -- A failing call (a write refused part way) answers its own caller; the
    -- calls before and after it in this batch are stored as they would be alone.
    local ok, err = pcall(store, at + 2, n, out)
    if ok then
      if token ~= '' then redis.call('ZADD', CALLS, server_ms, token) end
      reply[#reply + 1] = 'ok'
      reply[#reply + 1] = #out
      for _, v in ipairs(out) do reply[#reply + 1] = v end
    else
      if type(err) == 'table' then err = err.err or err.message end
      reply[#reply + 1] = 'err'
      reply[#reply + 1] = 1
      reply[#reply + 1] = tostring(err)
    end
  end
  at = at + 2 + n * 9
end
if earliest ~= nil and (before == nil or tonumber(before) > earliest) then
  redis.call('PUBLISH', WAKE_CHANNEL, tostring(earliest))
end
return reply
