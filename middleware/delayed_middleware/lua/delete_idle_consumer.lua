-- DELETE_IDLE_CONSUMER (broker): remove a subscription's consumer only if it holds nothing.
-- KEYS: 1 topic stream
-- ARGV: 1 group, 2 consumer
-- Returns 1 deleted, 0 it still holds pending entries, -1 no stream or no group.
-- XGROUP DELCONSUMER drops a consumer's PEL, which would lose those messages
-- for good; atomic, so nothing can be delivered to it between check and delete.
if redis.call('EXISTS', KEYS[1]) == 0 then return -1 end
local ok, pending = pcall(redis.call, 'XPENDING', KEYS[1], ARGV[1], '-', '+', 1, ARGV[2])
if not ok then return -1 end
if #pending > 0 then return 0 end
redis.call('XGROUP', 'DELCONSUMER', KEYS[1], ARGV[1], ARGV[2])
return 1
