-- RETRY_TAKE (retry poller, reclaim pass): take the retry records that are due.
-- KEYS: 1 the retry schedule (sorted set), 2 its counts (hash), both in one slot
-- ARGV: 1 now ms, then entry ids
-- Returns one number per id: -1 not taken (no record, or one not yet due: a newer
-- record written since the caller read the schedule), else the delivery count the
-- record was written for (0: a record of an older version, written without one).
-- Removing the record is the token: of the streams racing for it, one takes it.
local SCHEDULE, COUNTS = KEYS[1], KEYS[2]
local NOW = tonumber(ARGV[1])
local out = {}
for i = 2, #ARGV do
  local id = ARGV[i]
  local due = redis.call('ZSCORE', SCHEDULE, id)
  if due and tonumber(due) <= NOW then
    redis.call('ZREM', SCHEDULE, id)
    out[#out + 1] = tonumber(redis.call('HGET', COUNTS, id)) or 0
    redis.call('HDEL', COUNTS, id)
  else
    out[#out + 1] = -1
  end
end
return out
