-- RETRY_DEAD_APPEND (`delayed-pubsub retry-dead` on Redis Cluster, when the dead-letter
-- topic and the destination live in other slots): phase 1 of 2, in the DESTINATION's
-- slot. The caller deletes each letter from the dead-letter topic after (phase 2).
-- KEYS: 1 the destination stream (a topic, or the outbox), 2..n+1 each letter's retry
--       marker (keys.dead_retry_marker: the destination's slot, the engine's namespace)
-- ARGV: 1 marker TTL ms, then per letter: m field/value pairs, then the 2m strings
-- Returns one status per letter: 'moved' (appended now), 'dup' (its marker was set:
-- appended before, by this or another operator, so it is only to be deleted), or, for
-- every letter, the error that kept the destination from taking them.
-- Why exactly once: the marker is set with NX in the same atomic step as the XADD,
-- so of two operators racing over a letter one appends it and the other finds the
-- marker; a crash between the phases leaves the letter listed, and retrying it again
-- finds the marker and only deletes it (while the marker lives: ARGV[1]).
local DEST = KEYS[1]
local TTL_MS = ARGV[1]
local out = {}
local t = redis.call('TYPE', DEST).ok
local bad = nil
if t ~= 'stream' and t ~= 'none' then bad = 'WRONGTYPE: ' .. DEST .. ' is a ' .. t .. ', not a stream' end
local pos, i = 2, 1
while pos <= #ARGV do
  local m = tonumber(ARGV[pos])
  local first, last = pos + 1, pos + 2 * m
  pos = last + 1
  if bad then
    out[i] = bad
  elseif redis.call('SET', KEYS[i + 1], '1', 'NX', 'PX', TTL_MS) then
    redis.call('XADD', DEST, '*', unpack(ARGV, first, last))
    out[i] = 'moved'
  else
    out[i] = 'dup'
  end
  i = i + 1
end
return out
