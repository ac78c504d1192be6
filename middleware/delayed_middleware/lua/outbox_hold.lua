-- OUTBOX_HOLD (forwarder): keep the outbox entries a forwarder is handing off, and say
-- which it still holds.
-- KEYS: 1 outbox stream
-- ARGV: 1 group, 2 consumer, then pairs (entry id, the delivery count the holder took it at)
-- Returns the ids still held, in ARGV order.
-- Held: pending under this consumer at that count. Their idle time is reset (JUSTID: the
-- count stays), so no other forwarder takes them over as abandoned while the holder is
-- alive, however long daprd is down or a call takes. An entry another forwarder claimed
-- since (its count went up), or that was acked, is not held: its holder must not publish
-- it. One deleted while pending is acked away (Redis 6.2's XCLAIM would leave it in the
-- pending list for good) and is not held either: nothing is left to hand off.
local STREAM = KEYS[1]
local GROUP, CONSUMER = ARGV[1], ARGV[2]
local held = {}
for i = 3, #ARGV, 2 do
  local id, count = ARGV[i], tonumber(ARGV[i + 1])
  local row = redis.call('XPENDING', STREAM, GROUP, id, id, 1)[1]
  if row and row[2] == CONSUMER and tonumber(row[4]) == count then
    if redis.call('XRANGE', STREAM, id, id)[1] then
      redis.call('XCLAIM', STREAM, GROUP, CONSUMER, 0, id, 'JUSTID')
      held[#held + 1] = id
    else
      redis.call('XACK', STREAM, GROUP, id)
    end
  end
end
return held
