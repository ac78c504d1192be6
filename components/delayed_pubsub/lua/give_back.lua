-- GIVE_BACK (broker, a closing stream): entries read or claimed into the stream's buffer
-- and never sent to the subscriber are given back to the group as they were before.
-- KEYS: 1 topic stream
-- ARGV: 1 group, 2 consumer, 3 idle ms to give them (processingTimeout),
--       then pairs (entry id, delivery count the stream read or claimed it at)
-- Returns how many were given back.
-- Reading an entry into the buffer bumped its delivery count, yet nothing was
-- delivered: left so, an entry buffered by two streams that closed in turn (two
-- rolling restarts) would be dead-lettered by maxDeliveryAttempts 2 unseen. Each entry
-- still ours under the count we took it at gets that count minus one back, and an idle
-- time of processingTimeout, so the next reclaim pass of any stream takes it at once.
-- One another stream took over since (a different consumer or count) is left alone:
-- its delivery is that stream's. JUSTID: the claim itself bumps nothing.
-- Crash points: none that lose an entry; one not given back (the call failed, the
-- process died) comes back after processingTimeout, one delivery attempt higher, as
-- before.
local STREAM = KEYS[1]
local GROUP, CONSUMER, IDLE_MS = ARGV[1], ARGV[2], ARGV[3]
local n = 0
for i = 4, #ARGV, 2 do
  local id, count = ARGV[i], tonumber(ARGV[i + 1])
  local row = redis.call('XPENDING', STREAM, GROUP, id, id, 1)[1]
  if row and row[2] == CONSUMER and tonumber(row[4]) == count and count > 0 then
    redis.call('XCLAIM', STREAM, GROUP, CONSUMER, 0, id, 'IDLE', IDLE_MS, 'RETRYCOUNT', count - 1, 'JUSTID')
    n = n + 1
  end
end
return n
