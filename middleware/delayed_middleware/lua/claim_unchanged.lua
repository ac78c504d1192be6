-- CLAIM_UNCHANGED (broker: reclaim pass and retry poller): deliver pending entries
-- again, each only if nobody delivered it since the caller read its delivery count.
-- KEYS: 1 topic stream
-- ARGV: 1 group, 2 consumer, 3 min idle ms (0: any), then pairs (entry id, delivery count read)
-- Returns {{id, {field, value, ...}, delivery count now}, ...} for the entries claimed.
-- Every delivery of an entry is a claim that bumps its count, so two streams that
-- read the same count and race for it cannot both win: a retry poller that took
-- the entry's retry record and a reclaim pass that then found no record, say.
-- An entry acked meanwhile is skipped; one deleted or trimmed meanwhile is
-- dropped from the PEL by XCLAIM itself (Redis 7) and left out.
local STREAM = KEYS[1]
local GROUP, CONSUMER, MIN_IDLE_MS = ARGV[1], ARGV[2], ARGV[3]
local out = {}
for i = 4, #ARGV, 2 do
  local id, expected = ARGV[i], tonumber(ARGV[i + 1])
  local row = redis.call('XPENDING', STREAM, GROUP, id, id, 1)[1]
  if row and tonumber(row[4]) == expected then
    -- min idle: a nacked entry its stream has just held again (NACK_HOLD) is not abandoned.
    local claimed = redis.call('XCLAIM', STREAM, GROUP, CONSUMER, MIN_IDLE_MS, id)[1]
    if claimed and claimed[2] then
      out[#out + 1] = {claimed[1], claimed[2], expected + 1}
    end
  end
end
return out
