-- NACK_HOLD (broker, retry policy): hold a nacked entry while its fate is decided,
-- unless another stream of the group has delivered it since.
-- KEYS: 1 topic stream
-- ARGV: 1 group, 2 consumer, 3 entry id, 4 the delivery count the nacking stream sent it as (0: unknown, any)
-- Returns {delivery count in the PEL (0: not pending), the entry's fields or false}.
-- Fields only when the count is still the one sent: the entry then has its idle
-- time reset (JUSTID: the count stays), so no reclaim pass takes it before the
-- retry record is written. A different count means a reclaim pass delivered it
-- again meanwhile (the app took longer than processingTimeout): that delivery
-- is the retry, and this nack is about an attempt that is over.
local STREAM = KEYS[1]
local GROUP, CONSUMER, ID, SENT = ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[4])
local row = redis.call('XPENDING', STREAM, GROUP, ID, ID, 1)[1]
if not row then return {0, false} end
local count = tonumber(row[4])
if SENT > 0 and count ~= SENT then return {count, false} end
local entry = redis.call('XRANGE', STREAM, ID, ID)[1]
if not entry then
  -- Deleted or trimmed while pending: nothing to retry, and on Redis 6.2 nothing else
  -- would ever take it out of the PEL.
  redis.call('XACK', STREAM, GROUP, ID)
  return {0, false}
end
redis.call('XCLAIM', STREAM, GROUP, CONSUMER, 0, ID, 'JUSTID')
return {count, entry[2]}
