-- RETRY_RECORD (retry policy): write when a nacked entry may come back, and the
-- delivery count it was nacked at, together.
-- KEYS: 1 the retry schedule (sorted set), 2 its counts (hash), both in one slot
-- ARGV: 1 entry id, 2 due ms, 3 the delivery count the nack was about
-- The poller claims the entry under that count, not under whatever count it
-- reads when the record falls due: if the entry was delivered again in between
-- (a reclaim pass while this record was held up on its way here), that delivery
-- was the retry and the record is stale.
local SCHEDULE, COUNTS = KEYS[1], KEYS[2]
local ID, DUE_MS, COUNT = ARGV[1], ARGV[2], ARGV[3]
redis.call('ZADD', SCHEDULE, DUE_MS, ID)
redis.call('HSET', COUNTS, ID, COUNT)
return 1
