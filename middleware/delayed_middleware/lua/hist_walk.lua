-- HIST_WALK (read only): the records of one id, newest first, along the chain
-- of the history's by-id index (lua/history.lua), a page at a time.
-- KEYS: 1 history stream, 2 its by-id index hash
-- ARGV: 1 the id, 2 the link to start at ('' = the id's newest record),
--       3 a lower bound: stop at records at or before this entry id ('' = none),
--       4 max records
-- Returns {state, link, marker, first, entry id 1, fields 1, entry id 2, ...}:
--   state 'start': the chain's first record was reached; 'low': the lower bound
--   was; 'more': max records were read, continue at `link`; 'gap': `link` is
--   missing though not trimmed (a rewritten record): the id's older records
--   are found by a scan below it; 'trimmed': the rest was trimmed; 'none':
--   the index does not know the id.
--   marker: the first record indexed ('' = none yet): older records predate
--   the index. first: the history's first entry id ('' = empty).
local history, index = KEYS[1], KEYS[2]
local ID, LINK, LOW, MAX_RECORDS = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
--!include streamid.lua
local id, low, max = ID, LOW, tonumber(MAX_RECORDS)
local marker = redis.call('HGET', index, '') or ''
local head = redis.call('XRANGE', history, '-', '+', 'COUNT', 1)[1]
local first = head and head[1] or ''
local link = LINK
if link == '' then link = redis.call('HGET', index, id) or '' end
local out = {'none', '', marker, first}
if link == '' then return out end
local n = 0
while true do
  if low ~= '' and not id_before(low, link) then out[1] = 'low'; break end
  if n >= max then out[1] = 'more'; break end
  local e = redis.call('XRANGE', history, link, link)[1]
  if not e then
    out[1] = (first == '' or id_before(link, first)) and 'trimmed' or 'gap'
    break
  end
  out[#out + 1] = e[1]
  out[#out + 1] = e[2]
  n = n + 1
  local prev = ''
  local f = e[2]
  for i = 1, #f, 2 do
    if f[i] == 'prev' then prev = f[i + 1] end
  end
  if prev == '' then out[1] = 'start'; break end
  link = prev
end
out[2] = link
return out
