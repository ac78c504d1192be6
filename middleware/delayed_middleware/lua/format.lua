-- FORMAT: settle the storage format of one shard of an app's delayed topic.
-- KEYS: 1 the format key ({<shard stream>}:format), 2.. the shard's data keys
--       (stream, due index, ids, history, parked, outbox, moved, retrying, dead letters)
-- ARGV: 1 the format to write: raised to it when the stored one is lower, never lowered;
--       '0' writes nothing (a read)
-- Returns {stored, data}: the format stored after this call ('' when none), and how many
--       of the data keys exist (a shard without a format key but with data was written
--       by a release older than format keys: format 1).
--
-- Why a script: two replicas starting at once, one raising the format and one
-- keeping it, must not lower it by racing; the stored value only ever goes up.
local want = tonumber(ARGV[1])
local stored = redis.call('GET', KEYS[1])
local data = 0
for i = 2, #KEYS do
  data = data + redis.call('EXISTS', KEYS[i])
end
if want > 0 then
  local have = stored and tonumber(stored)
  -- A value this script cannot read as a number is never overwritten: the caller refuses it.
  if stored == false or (have ~= nil and have < want) then
    redis.call('SET', KEYS[1], ARGV[1])
    stored = ARGV[1]
  end
end
return {stored or '', data}
