-- RETRY_RECORD (retry policy): write when a nacked entry may come back, and the
-- delivery count it was nacked at, together.
-- KEYS: 1 the retry schedule (sorted set), 2 its counts (hash), both in one slot
-- ARGV: 1 entry id, 2 due ms, 3 the delivery count the nack was about
-- Returns 1 written, 0 left alone (the live record is about a later delivery).
-- The poller claims the entry under that count, not under whatever count it
-- reads when the record falls due: if the entry was delivered again in between
-- (a reclaim pass while this record was held up on its way here), that delivery
-- was the retry and the record is stale.
-- The counts hash holds "count:due ms": a count is trusted only beside the record
-- it was written with. An older version's replica takes records without removing
-- their counts and writes records without one; a count left over from before
-- then sits beside a record whose due time is not its own, and is ignored.
-- A record held up on its way here (a lost reply, a slow link) can land after the
-- entry was delivered again, failed again and got a newer record: that newer
-- record, about a later delivery, stays.
local SCHEDULE, COUNTS = KEYS[1], KEYS[2]
local ID, DUE_MS, COUNT = ARGV[1], ARGV[2], ARGV[3]
local live = redis.call('ZSCORE', SCHEDULE, ID)
if live then
  local stored = redis.call('HGET', COUNTS, ID)
  local count, due = string.match(stored or '', '^(%d+):(%d+)$')
  if count and tonumber(due) == tonumber(live) and tonumber(count) > tonumber(COUNT) then
    return 0
  end
end
redis.call('ZADD', SCHEDULE, DUE_MS, ID)
redis.call('HSET', COUNTS, ID, COUNT .. ':' .. DUE_MS)
return 1
