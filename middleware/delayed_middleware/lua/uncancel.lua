-- UNCANCEL (two-phase fire, Redis Cluster): a cancel found that the occurrence
-- it withdrew in flight had already been appended (its fire marker was set by
-- APPEND, not by the canceller): the one-shot went out, and the cancel answers
-- "not cancelled". Its `cancelled` history record becomes the `fired` record
-- RELEASE cannot write (the envelope is gone): same fields, event `fired`, at =
-- now, lateness from its due time, no reason. In the shard's slot, atomic.
-- KEYS: 1 history stream
-- ARGV: 1 the `cancelled` record's entry id, 2 now ms, 3 history maxlen
-- Returns 1 when rewritten, 0 when the record is gone (trimmed).
local e = redis.call('XRANGE', KEYS[1], ARGV[1], ARGV[1])[1]
if not e then return 0 end
local f = e[2]
local due = nil
for i = 1, #f, 2 do
  if f[i] == 'due' then due = tonumber(f[i + 1]) end
end
local args = {KEYS[1], 'MAXLEN', '~', ARGV[3], '*'}
for i = 1, #f, 2 do
  local k, v = f[i], f[i + 1]
  if k == 'event' then v = 'fired'
  elseif k == 'at' then v = ARGV[2]
  elseif k == 'reason' then v = ''
  elseif k == 'late' and due then v = tostring(tonumber(ARGV[2]) - due)
  end
  args[#args + 1] = k
  args[#args + 1] = v
end
redis.call('XDEL', KEYS[1], ARGV[1])
redis.call('XADD', unpack(args))
return 1
