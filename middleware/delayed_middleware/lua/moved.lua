-- LIBRARY moved.lua: where an envelope is stored now (see compact.lua).
-- Expects the including script's locals STREAM (the delayed stream) and
-- MOVED (the moved hash, always the last key).
--
-- Compaction re-homes long-waiting envelopes to the delayed topic's tail, so
-- the stream nodes they pinned are freed. A re-homed envelope keeps its first
-- stream id: the index, the ids hash, parked, the claims of the two-phase fire,
-- the history and users (pending, inspect, cancel) all name it by that id. The
-- moved hash maps that id to the stream id it is stored at now; an envelope
-- never moved has no entry there. Every read or delete of an envelope by id
-- goes through here.
-- True when the moved hash was empty as the script began and the script adds
-- no moves (FIRE sets it): then no envelope is stored elsewhere than at its id,
-- and reads skip the lookup (an HGET per envelope fired).
local MOVED_NONE = false

-- The stream id envelope `id` is stored at now.
local function stored_at(id)
  if MOVED_NONE then return id end
  return redis.call('HGET', MOVED, id) or id
end

-- Deletes the envelopes with these ids from the delayed topic, wherever they
-- are stored, and forgets their moves; returns how many entries were deleted.
local function delete_envelopes(ids)
  local at = ids
  if redis.call('EXISTS', MOVED) == 1 then
    at = {}
    local moved = {}
    for i = 1, #ids, 500 do
      local got = redis.call('HMGET', MOVED, unpack(ids, i, math.min(i + 499, #ids)))
      for j = 1, #got do
        local id = ids[i + j - 1]
        if got[j] then
          at[#at + 1] = got[j]
          moved[#moved + 1] = id
        else
          at[#at + 1] = id
        end
      end
    end
    for i = 1, #moved, 500 do
      redis.call('HDEL', MOVED, unpack(moved, i, math.min(i + 499, #moved)))
    end
  end
  local n = 0
  for i = 1, #at, 500 do
    n = n + redis.call('XDEL', STREAM, unpack(at, i, math.min(i + 499, #at)))
  end
  return n
end

-- Forgets the move of envelope `id`, whose stored entry someone else deleted
-- (an operator's XDEL/XTRIM): the record would otherwise outlive it for good.
local function forget_move(id)
  redis.call('HDEL', MOVED, id)
end
