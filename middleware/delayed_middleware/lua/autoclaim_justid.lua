-- AUTOCLAIM_JUSTID (broker): take over entries other consumers abandoned.
-- KEYS: 1 topic stream
-- ARGV: 1 group, 2 consumer, 3 min idle ms, 4 start id, 5 count
-- Returns XAUTOCLAIM's whole reply: {next start id, ids, deleted ids}.
-- JUSTID does not bump delivery counts (entries we already hold must not count
-- as redelivered); and redis-py's parser drops the next-start cursor of a
-- JUSTID reply, so the script hands the reply back as it is.
local STREAM = KEYS[1]
local GROUP, CONSUMER, MIN_IDLE_MS, START, COUNT = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5]
return redis.call('XAUTOCLAIM', STREAM, GROUP, CONSUMER, MIN_IDLE_MS, START, 'COUNT', COUNT, 'JUSTID')
