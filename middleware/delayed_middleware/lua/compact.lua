-- COMPACT: re-home the envelopes of one stretch of the delayed topic to its
-- tail, so the stream nodes they kept allocated are freed.
-- KEYS: the engine's (1 delayed stream, ...), the moved hash last (moved.lua)
-- ARGV: 1 cursor: the last stream id walked ('-' from the start), 2 the pass's
--       end: the stream's last id when the pass began (the copies land after it,
--       so a pass ends), 3 max entries, 4 Redis time budget us (0 = none)
-- Returns {cursor, moved}: the last stream id walked ('' once the pass reached
-- its end), and how many envelopes were re-homed by this call.
--
-- Why: XDEL only flags an entry deleted; a stream node (a listpack of up to
-- stream-node-max-entries / -bytes) is freed once all its entries are. One
-- message waiting a day among a hundred fired ones keeps its whole node.
-- Copying it to the tail (XADD) and deleting the original frees the node; the
-- copies of one call sit together, densely. The envelope keeps its public id
-- (its first stream id): the copy carries it in field `origin`, and the moved
-- hash points from it to the copy, in this same atomic step, so every script
-- (FIRE, CLAIM, RELEASE, CANCEL, a replace) finds it, before or after, and
-- nothing is lost or doubled. Readers of the delayed topic show a copy under
-- its `origin` id; field `from` names the entry it was copied from. Bounded: max entries per call and a Redis time budget.
local STREAM, MOVED = KEYS[1], KEYS[#KEYS]
local CURSOR, LAST, MAX_ENTRIES, BUDGET_US = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
--!include moved.lua
--!include budget.lua
local cursor, last, max = CURSOR, LAST, tonumber(MAX_ENTRIES)
local spent = walk_budget(tonumber(BUDGET_US or '0'))
local from = cursor == '-' and '-' or '(' .. cursor
local rows = redis.call('XRANGE', STREAM, from, last, 'COUNT', max)
local moved = 0
for i, e in ipairs(rows) do
  if spent(i) then break end
  local id, f = e[1], e[2]
  local origin = id
  local args = {STREAM, '*'}
  for j = 1, #f, 2 do
    if f[j] == 'from' then
      -- Ours (below), rewritten on each move.
    elseif f[j] == 'origin' then
      -- Only the copy the moved hash points at is that envelope: anyone can
      -- XADD an `origin` field, and trusting it would make their entry fire
      -- in a pending message's place (and orphan the real copy). Any other
      -- entry is re-homed under its own id, the untrusted field dropped.
      if redis.call('HGET', MOVED, f[j + 1]) == id then origin = f[j + 1] end
    else
      args[#args + 1] = f[j]
      args[#args + 1] = f[j + 1]
    end
  end
  args[#args + 1] = 'origin'
  args[#args + 1] = origin
  -- Where this copy comes from: a reader paging through the stream while a
  -- pass runs tells by it whether it already met the envelope there
  -- (inspector.py's _Walk), so it lists each message once.
  args[#args + 1] = 'from'
  args[#args + 1] = id
  local copy = redis.call('XADD', unpack(args))
  redis.call('XDEL', STREAM, id)
  redis.call('HSET', MOVED, origin, copy)
  cursor = id
  moved = moved + 1
end
if #rows < max and moved == #rows then cursor = '' end
return {cursor, moved}
