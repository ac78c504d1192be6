-- CLAIM_UNCHANGED (broker: reclaim pass and retry poller): deliver pending entries
-- again, each only if nobody delivered it since the caller read its delivery count,
-- and only while it has deliveries left: one whose count reached the maximum is
-- claimed to be given up (dead-lettered by the caller) instead.
-- KEYS: 1 topic stream, 2 this claim's memo (a key in the topic's slot, unique per call)
-- ARGV: 1 group, 2 consumer, 3 min idle ms (0: any), 4 how long the memo is kept (ms),
--       5 maxDeliveryAttempts (0: unlimited),
--       then pairs (entry id, delivery count read)
-- Returns {{id, {field, value, ...}, delivery count now, 1 if given up else 0}, ...}
-- for the entries claimed.
-- Every delivery of an entry is a claim that bumps its count, so two streams that
-- read the same count and race for it cannot both win: a retry poller that took
-- the entry's retry record and a reclaim pass that then found no record, say.
-- The claim that gives an entry up bumps the count too, so of two streams that
-- find it used up, one gives it up (writes the dead letter) and the other nothing;
-- and no stream delivers it again: its count is at the maximum or past it. A
-- delivery that outlasted processingTimeout has counted (its claim bumped the
-- count), however it ends: a nack that comes after the takeover changes nothing.
-- An entry acked meanwhile is skipped; one deleted or trimmed meanwhile is
-- acked away here (Redis 6.2's XCLAIM leaves a deleted id in the PEL for good)
-- and left out.
-- The memo makes a repeat of the same call (its reply was lost, the caller sent it
-- again) hand back what the first run claimed, instead of nothing: the first run
-- bumped the counts, and without it the entries would wait out processingTimeout
-- and come back one delivery attempt later. Only the call that wrote the memo
-- knows its name, so a repeat cannot take an entry another claimer bumped.
local STREAM, MEMO = KEYS[1], KEYS[2]
local GROUP, CONSUMER, MIN_IDLE_MS, MEMO_MS = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local MAX = tonumber(ARGV[5])
local out = {}
if redis.call('EXISTS', MEMO) == 1 then
  for i = 6, #ARGV, 2 do
    local id, expected = ARGV[i], tonumber(ARGV[i + 1])
    local given_up = tonumber(redis.call('HGET', MEMO, id) or '0')
    if given_up > 0 then
      local row = redis.call('XPENDING', STREAM, GROUP, id, id, 1)[1]
      -- Still ours at the count the first run gave it: nobody has taken it over since.
      if row and row[2] == CONSUMER and tonumber(row[4]) == expected + 1 then
        local entry = redis.call('XRANGE', STREAM, id, id)[1]
        if entry then
          out[#out + 1] = {entry[1], entry[2], expected + 1, given_up - 1}
        end
      end
    end
  end
  return out
end
for i = 6, #ARGV, 2 do
  local id, expected = ARGV[i], tonumber(ARGV[i + 1])
  local row = redis.call('XPENDING', STREAM, GROUP, id, id, 1)[1]
  if row and tonumber(row[4]) == expected then
    if not redis.call('XRANGE', STREAM, id, id)[1] then
      redis.call('XACK', STREAM, GROUP, id)
    else
      -- min idle: a nacked entry its stream has just held again (NACK_HOLD) is not abandoned.
      local claimed = redis.call('XCLAIM', STREAM, GROUP, CONSUMER, MIN_IDLE_MS, id)[1]
      if claimed and claimed[2] then
        local used_up = (MAX > 0 and expected >= MAX) and 1 or 0
        out[#out + 1] = {claimed[1], claimed[2], expected + 1, used_up}
        -- 1: claimed to deliver, 2: claimed to give up (what a repeat hands back).
        redis.call('HSET', MEMO, id, 1 + used_up)
      end
    end
  end
end
if #out > 0 then
  redis.call('PEXPIRE', MEMO, MEMO_MS)
end
return out
