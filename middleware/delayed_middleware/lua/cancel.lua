-- CANCEL: withdraw pending messages or schedules; nothing more is delivered.
-- KEYS: 1 delayed stream, 2 index top, 3 ids hash, 4 bucket seq, 5 pending count,
--       6 history, 7 parked, 8 call tokens, 9 refill, 10 outbox
-- ARGV: 1 bucket key prefix, 2 now ms, 3 history maxlen, 4 reason, 5 n, then n ids
--       (each a scheduleId, or an envelope's stream id on the delayed topic)
-- Returns two values per id: 1 when something pending (or parked) was cancelled,
-- else 0; and the cancelled message's topic ('' when unknown), for markers.
-- Bounded: the caller sends at most a few hundred ids per call.
--!include index.lua
--!include decode.lua
--!include history.lua
--!include common.lua
local function cancel_one(key)
  local ref = redis.call('HGET', KEYS[3], key)
  local sid, due
  if ref then
    sid = parse_ref(ref)
  else
    -- Not an id in the hash: maybe a stream id of an envelope without scheduleId.
    if not string.match(key, '^%d+%-%d+$') then return 0, '' end
    -- Digits beyond a stream id's 64-bit parts: XRANGE would refuse it, and an
    -- id that cannot exist names nothing pending.
    if not pcall(redis.call, 'XRANGE', KEYS[1], key, key, 'COUNT', 1) then return 0, '' end
    sid = key
  end
  local env = read_envelope(sid)
  if ref then
    local _
    _, due = drop_ref(key, ref)
    redis.call('HDEL', KEYS[3], key)
  else
    if redis.call('XDEL', KEYS[1], sid) == 0 then return 0, '' end
    if env then
      due = env.due
      local r = env.sid ~= '' and redis.call('HGET', KEYS[3], env.sid)
      if r and parse_ref(r) == sid then
        -- Its ref knows where it waits now: a recurring envelope moves on after
        -- each fire (or waits for REFILL outside the index).
        local _, rdue, _, _, flag = parse_ref(r)
        due = rdue
        if flag ~= 'u' then remove(sid, rdue) end
        redis.call('HDEL', KEYS[3], env.sid)
        redis.call('ZREM', KEYS[9], env.sid)
      else
        remove(sid, due)
      end
    end
    redis.call('HDEL', KEYS[7], sid)
  end
  if env then
    hist('cancelled', key, env.sid, env.topic, env.kind, due or '', '', env.size, 1, ARGV[4], env.schedule)
    return 1, env.topic
  end
  hist('cancelled', key, '', '', 0, due or '', '', '', 1, ARGV[4], '')
  return 1, ''
end

HIST_MAXLEN, HIST_NOW = tonumber(ARGV[3]), ARGV[2]
local out = {}
for i = 1, tonumber(ARGV[5]) do
  local found, topic = cancel_one(ARGV[5 + i])
  out[#out + 1] = found
  out[#out + 1] = topic
end
return out
