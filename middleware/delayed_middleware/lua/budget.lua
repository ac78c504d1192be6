-- LIBRARY budget.lua: a call's budget of Redis time, read on the server's clock,
-- shared by the bounded walks (batch.lua's FIRE and CLAIM, compact.lua, recover.lua).
-- Two locals only: FIRE and CLAIM include it, and a Lua chunk holds at most 200.

-- The Redis server's clock, in microseconds.
local function clock_us()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000000 + tonumber(t[2])
end

-- A walk over stream entries (COMPACT, RECOVER) given `budget_us` us of Redis
-- time (0 = none), starting now: returns spent(i), true once the walk has run
-- for its budget at entry `i`. The clock is read every 16 entries; the first
-- entry always goes, so every call makes progress.
local function walk_budget(budget_us)
  local started = budget_us > 0 and clock_us() or 0
  return function(i)
    return budget_us > 0 and i > 1 and i % 16 == 0 and clock_us() - started > budget_us
  end
end
