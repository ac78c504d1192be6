-- RETRY_DEAD (`delayed-pubsub retry-dead`, the dashboard's Retry): move dead letters
-- back, each exactly once, when the dead-letter topic and the destination share a
-- slot (always on a single node; on Redis Cluster when both hash alike).
-- KEYS: 1 the dead-letter topic, 2 the destination stream (a topic, or the outbox)
-- ARGV: per letter: its stream id on KEYS[1], m field/value pairs, then the 2m strings
-- Returns one status per letter: 'moved' (deleted from KEYS[1] and appended to KEYS[2]
-- now), 'gone' (not on KEYS[1] any more: another operator moved or deleted it), or,
-- for every letter, the error that kept the destination from taking them (nothing
-- is deleted then).
-- Why exactly once: XDEL says whether it removed the entry, and only the call
-- that removed it appends the copy, in the same atomic step. Two operators (or a
-- double click) racing over the same letters each move a disjoint part.
local DEAD, DEST = KEYS[1], KEYS[2]
local out = {}
local t = redis.call('TYPE', DEST).ok
if t ~= 'stream' and t ~= 'none' then
  local bad = 'WRONGTYPE: ' .. DEST .. ' is a ' .. t .. ', not a stream'
  local pos = 1
  while pos <= #ARGV do
    out[#out + 1] = bad
    pos = pos + 2 + 2 * tonumber(ARGV[pos + 1])
  end
  return out
end
local pos = 1
while pos <= #ARGV do
  local id, m = ARGV[pos], tonumber(ARGV[pos + 1])
  local first, last = pos + 2, pos + 1 + 2 * m
  pos = last + 1
  if redis.call('XDEL', DEAD, id) == 1 then
    -- At most a letter's few fields: no chunking needed for unpack.
    redis.call('XADD', DEST, '*', unpack(ARGV, first, last))
    out[#out + 1] = 'moved'
  else
    out[#out + 1] = 'gone'
  end
end
return out
