-- LIBRARY streamid.lua: stream entry ids compared in stream order.

-- True when entry id `a` comes before `b` ('<ms>-<seq>', compared as numbers
-- of any length: no float rounding); false when either is not an entry id.
local function id_before(a, b)
  local am, as = string.match(a, '^(%d+)%-(%d+)$')
  local bm, bs = string.match(b, '^(%d+)%-(%d+)$')
  if not am or not bm then return false end
  if #am ~= #bm then return #am < #bm end
  if am ~= bm then return am < bm end
  if #as ~= #bs then return #as < #bs end
  return as < bs
end
