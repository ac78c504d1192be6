-- HIST_SWEEP: drops by-id index fields (history.lua) whose newest record the
-- history no longer holds (trimmed by length or age), a page at a time, so
-- the index stays as long as the history. A field is dropped only if it still
-- points before the history's first record: a writer that moved it on since
-- the page was read keeps it. The field '' (where indexing began) stays; a
-- sweep's first page sets it when missing and the history holds records, to
-- the last of them: every record after it was written by an indexing writer
-- (an empty history gets '0-0' from its first record: history.lua).
-- KEYS: 1 history stream, 2 its by-id index hash
-- ARGV: 1 HSCAN cursor, 2 page size
-- Returns {next cursor ('0' when the sweep is through), fields dropped}.
local HISTORY, INDEX = KEYS[1], KEYS[2]
local CURSOR, PAGE_SIZE = ARGV[1], ARGV[2]
--!include streamid.lua
if CURSOR == '0' and redis.call('HEXISTS', INDEX, '') == 0 then
  local last = redis.call('XREVRANGE', HISTORY, '+', '-', 'COUNT', 1)[1]
  if last then redis.call('HSET', INDEX, '', last[1]) end
end
local first = redis.call('XRANGE', HISTORY, '-', '+', 'COUNT', 1)[1]
local page = redis.call('HSCAN', INDEX, CURSOR, 'COUNT', tonumber(PAGE_SIZE))
local gone = {}
local fields = page[2]
for i = 1, #fields, 2 do
  local id, at = fields[i], fields[i + 1]
  if id ~= '' and (not first or id_before(at, first[1])) then gone[#gone + 1] = id end
end
for i = 1, #gone, 500 do
  redis.call('HDEL', INDEX, unpack(gone, i, math.min(i + 499, #gone)))
end
return {page[1], #gone}
