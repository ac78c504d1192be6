-- LIBRARY inflight.lua: the two-phase fire's in-flight set (claim.lua, release.lua).
-- Needs index.lua and common.lua (is_instant) included before it. Expects the including
-- script's local INFLIGHT (the in-flight zset, score = lease end ms).

-- A claim record's fields (the CLAIMS value CLAIM writes: `due next_due iso key`): due, next
-- due, occurrence, scheduler key; nothing when it is torn (written by hand: a field missing,
-- or a next time that is no instant, which would go into the index at 'inf', or raise).
local function read_claim(rec)
  local due, next_due, iso, key = string.match(rec or '', '^(%S+) (%S+) (%S+) (.*)$')
  if key and (next_due == '-' or is_instant(next_due)) then return due, next_due, iso, key end
  return nil
end

-- When a shard next needs a replica: the earliest due time in the index or
-- the earliest lease end in flight (a takeover), whichever comes first; nil when neither.
local function next_wakeup()
  local h = head()
  local lease_end = redis.call('ZRANGE', INFLIGHT, 0, 0, 'WITHSCORES')[2]
  if lease_end and (h == nil or tonumber(lease_end) < tonumber(h)) then return lease_end end
  return h
end
