-- DELETE_IDLE_CONSUMER (broker): remove a subscription's consumer only if it holds nothing.
-- KEYS: 1 topic stream
-- ARGV: 1 group, 2 consumer
-- Returns 1 deleted, 0 it still holds pending entries, -1 no stream or no group.
-- XGROUP DELCONSUMER drops a consumer's PEL, which would lose those messages
-- for good; atomic, so nothing can be delivered to it between check and delete.
local STREAM = KEYS[1]
local GROUP, CONSUMER = ARGV[1], ARGV[2]
if redis.call('EXISTS', STREAM) == 0 then return -1 end
local ok, pending = pcall(redis.call, 'XPENDING', STREAM, GROUP, '-', '+', 1, CONSUMER)
if not ok then return -1 end
if #pending > 0 then return 0 end
redis.call('XGROUP', 'DELCONSUMER', STREAM, GROUP, CONSUMER)
return 1
