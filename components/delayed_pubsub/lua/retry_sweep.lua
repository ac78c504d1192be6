-- RETRY_SWEEP (retry poller): remove counts whose record is gone, a few per call.
-- KEYS: 1 the retry schedule (sorted set), 2 its counts (hash), both in one slot
-- ARGV: 1 HSCAN cursor, 2 how many fields to look at
-- Returns the next cursor ("0": a sweep went round, or there was nothing to sweep).
-- An older version's replica takes records without removing their counts: during a
-- rolling upgrade the hash would grow by one field per retry it delivered. Records
-- and counts are written together (RETRY_RECORD), so a field without a record is
-- one of those. Costs one HLEN and one ZCARD while there are no more fields than
-- records.
local SCHEDULE, COUNTS = KEYS[1], KEYS[2]
local CURSOR, STEP = ARGV[1], ARGV[2]
if redis.call('HLEN', COUNTS) <= redis.call('ZCARD', SCHEDULE) then
  return '0'
end
local page = redis.call('HSCAN', COUNTS, CURSOR, 'COUNT', STEP)
local fields = page[2]
for i = 1, #fields, 2 do
  if not redis.call('ZSCORE', SCHEDULE, fields[i]) then
    redis.call('HDEL', COUNTS, fields[i])
  end
end
return page[1]
