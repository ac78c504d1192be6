-- HIST_APPEND: one lifecycle record written outside the engine's scripts (the
-- subscriber retrier, the forwarder), linked into the by-id index like the
-- scripts' own (history.lua). Runs inside their MULTI: every key shares the
-- history's hash tag.
-- KEYS: 1 history stream
-- ARGV: 1 history maxlen (> 0), then the record's fields and values (no `prev`)
-- Returns the record's entry id.
local HISTORY, HIST_LEN = KEYS[1], ARGV[1]
--!include history.lua
HIST_MAXLEN = tonumber(HIST_LEN)
local fields, id = {}, ''
for i = 2, #ARGV, 2 do
  fields[#fields + 1] = ARGV[i]
  fields[#fields + 1] = ARGV[i + 1]
  if ARGV[i] == 'id' then id = ARGV[i + 1] end
end
return hist_fields(id, fields, nil)
