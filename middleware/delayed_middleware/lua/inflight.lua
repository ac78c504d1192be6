-- LIBRARY inflight.lua: the two-phase fire's in-flight set (claim.lua, release.lua).
-- Needs index.lua included before it. Expects the including script's
-- local INFLIGHT (the in-flight zset, score = lease end ms).

-- When a shard next needs a replica: the earliest due time in the index or
-- the earliest lease end in flight (a takeover), whichever comes first; nil when neither.
local function next_wakeup()
  local h = head()
  local lease_end = redis.call('ZRANGE', INFLIGHT, 0, 0, 'WITHSCORES')[2]
  if lease_end and (h == nil or tonumber(lease_end) < tonumber(h)) then return lease_end end
  return h
end
