-- UNCANCEL (two-phase fire, Redis Cluster): a cancel found that the occurrence
-- it withdrew in flight had already been appended (its fire marker was set by
-- APPEND, not by the canceller): the one-shot went out, and the cancel answers
-- "not cancelled". Its `cancelled` history record becomes the `fired` record
-- RELEASE cannot write (the envelope is gone): same fields, event `fired`, at =
-- now, lateness from its due time, no reason. In the shard's slot, atomic.
-- KEYS: 1 history stream
-- ARGV: 1 the `cancelled` record's entry id, 2 now ms, 3 history maxlen
-- Returns 1 when rewritten, 0 when the record is gone (trimmed).
local HISTORY = KEYS[1]
local RECORD_ID, NOW_MS, HIST_LEN = ARGV[1], ARGV[2], ARGV[3]
--!include history.lua
HIST_MAXLEN, HIST_NOW = tonumber(HIST_LEN), NOW_MS
local e = redis.call('XRANGE', HIST_KEY, RECORD_ID, RECORD_ID)[1]
if not e then return 0 end
local f = e[2]
local due, id, prev = nil, '', ''
for i = 1, #f, 2 do
  if f[i] == 'due' then due = tonumber(f[i + 1]) end
  if f[i] == 'id' then id = f[i + 1] end
  if f[i] == 'prev' then prev = f[i + 1] end
end
local fields = {}
for i = 1, #f, 2 do
  local k, v = f[i], f[i + 1]
  if k == 'event' then v = 'fired'
  elseif k == 'at' then v = HIST_NOW
  elseif k == 'reason' then v = ''
  elseif k == 'late' and due then v = tostring(tonumber(HIST_NOW) - due)
  end
  if k ~= 'prev' then
    fields[#fields + 1] = k
    fields[#fields + 1] = v
  end
end
redis.call('XDEL', HIST_KEY, RECORD_ID)
-- The new record takes the old one's place in its id's chain when the old one
-- was the newest; else it follows the newest, and the chain's link to the
-- deleted record is found missing by the reader, which scans from there.
if hist_indexed(id) and redis.call('HGET', HIST_INDEX, id) ~= RECORD_ID then prev = nil end
hist_fields(id, fields, prev)
return 1
