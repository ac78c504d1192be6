-- REFILL: give a recurring envelope its next due time, computed by a replica in
-- Python (cron arithmetic has no place in Lua). A compare-and-set on the ids
-- hash ref, so a refill racing a replace, a cancel or another replica's refill
-- changes nothing.
-- KEYS: 1 delayed stream, 2 index top, 3 ids hash, 4 bucket seq, 5 pending count,
--       6 history, 7 parked, 8 call tokens, 9 refill, 10 outbox
-- ARGV: 1 bucket key prefix, 2 wake channel, 3 envelope id (ids hash key),
--       4 the ref the replica read, 5 next due ms ('purge': the schedule ends
--       after the pending occurrence), 6 next due RFC3339 ('-' with purge)
-- Returns 1 applied, 0 stale (the caller re-reads), -1 the id is gone.
--!include index.lua
local key = ARGV[3]
local ref = redis.call('HGET', KEYS[3], key)
if not ref then
  redis.call('ZREM', KEYS[9], key)
  return -1
end
if ref ~= ARGV[4] then return 0 end
local sid, due, _, _, flag = parse_ref(ref)
if flag == 'u' then
  local before = head()
  insert(sid, due)
  if before == nil or tonumber(before) > tonumber(due) then redis.call('PUBLISH', ARGV[2], due) end
end
redis.call('HSET', KEYS[3], key, make_ref(sid, due, ARGV[5], ARGV[6], 'i'))
redis.call('ZREM', KEYS[9], key)
return 1
