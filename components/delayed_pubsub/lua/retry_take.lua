-- RETRY_TAKE (retry poller, reclaim pass): take the retry records that are due.
-- KEYS: 1 the retry schedule (sorted set), 2 its counts (hash), both in one slot
-- ARGV: 1 now ms, then entry ids
-- Returns one number per id: -1 not taken (no record, or one not yet due: a newer
-- record written since the caller read the schedule), else the delivery count the
-- record was written for (0: unknown, a record of an older version, written without
-- one; see RETRY_RECORD for why a count is trusted only beside its own due time).
-- Removing the record is the token: of the streams racing for it, one takes it.
-- A count found with no record at all was left by an older version's taker: it goes.
local SCHEDULE, COUNTS = KEYS[1], KEYS[2]
local NOW = tonumber(ARGV[1])
local out = {}
for i = 2, #ARGV do
  local id = ARGV[i]
  local due = redis.call('ZSCORE', SCHEDULE, id)
  if due and tonumber(due) <= NOW then
    redis.call('ZREM', SCHEDULE, id)
    local count, at = string.match(redis.call('HGET', COUNTS, id) or '', '^(%d+):(%d+)$')
    if count and tonumber(at) == tonumber(due) then
      out[#out + 1] = tonumber(count)
    else
      out[#out + 1] = 0
    end
    redis.call('HDEL', COUNTS, id)
  else
    if not due then
      redis.call('HDEL', COUNTS, id)
    end
    out[#out + 1] = -1
  end
end
return out
