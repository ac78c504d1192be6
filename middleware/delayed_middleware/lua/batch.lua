-- LIBRARY batch.lua: the walk over a due batch, shared by FIRE (fire.lua) and
-- CLAIM (claim.lua, Redis Cluster's first phase), so both decide every
-- occurrence the same way up to the append: budgets, gone and undecodable
-- envelopes, recurring successors, expiry, parking. Needs index.lua,
-- decode.lua, history.lua and common.lua included before it.
-- Expects the including script's locals STREAM, IDS, HISTORY, PARKED, REFILL_SET.
--!include budget.lua

-- Decoding and encoding a metadata pair costs about a quarter of appending an entry.
local METADATA_PER_ENTRY = 4

-- The batch so far: parked and gone counts, work and bytes spent against the
-- budgets, cheap envelopes since the clock was last read, candidates taken
-- out of the index, stream entries to delete, (id, topic) of what expired unfired.
local B = {parked = 0, gone = 0, work = 0, bytes = 0, unchecked = 0, taken = {}, deletes = {}, expired = {}}
local B_BUDGET_US, B_STARTED = 0, 0

-- Starts the Redis-time budget (us; 0 = none) of this call.
local function batch_start(budget_us)
  B_BUDGET_US = budget_us
  if budget_us > 0 then B_STARTED = clock_us() end
end

-- True once the batch has run for its time budget. The clock is read every 8
-- cheap envelopes, and after any costly one (decide() counts the cost); the
-- first candidate (i == 1) always goes, so every call makes progress.
local function out_of_time(i)
  if B_BUDGET_US > 0 and i > 1 and B.unchecked >= 8 then
    if clock_us() - B_STARTED > B_BUDGET_US then return true end
    B.unchecked = 0
  end
  B.unchecked = B.unchecked + 1
  return false
end

-- Why `topic` is not ours to append to (the engine's own namespace), or nil.
local function reserved(topic)
  if string.find(topic, '-delayed}', 1, true) then return 'reserved: an engine key' end
  if string.sub(topic, -8) == '-delayed' then return 'reserved: a delayed topic' end
  return nil
end

-- Keeps the envelope on the delayed topic, listed in PARKED with why, recorded.
local function park(id, env, key, due, why)
  redis.call('HSET', PARKED, id, why)
  B.parked = B.parked + 1
  if env then
    hist('parked', key, env.sid, env.topic, env.kind, due, '', env.size, math.max(env.attempt, 1), why, env.schedule)
  else
    hist('parked', key, '', '', 0, due, '', '', 1, why, '')
  end
end

-- Drops a delivered (or expired) envelope: its stream entry (with the batch's
-- deletes) and, if it still is the one its id names, its ids entry and refill mark.
local function forget(id, env, key)
  B.deletes[#B.deletes + 1] = id
  if env.sid ~= '' or env.kind == 1 then
    local r = redis.call('HGET', IDS, key)
    if r and parse_ref(r) == id then
      redis.call('HDEL', IDS, key)
      redis.call('ZREM', REFILL_SET, key)
    end
  end
end

-- An occurrence's metadata as it goes out, JSON-encoded: the entry's own, with
-- `scheduler` (the schedule's id), `scheduleNext` (its next time, or '-') and
-- `scheduleOccurrence` (`occ`: the occurrence's nominal time, RFC 3339; nil
-- leaves the entry's own, as a subscriber retry carries the first delivery's).
-- nil and why when cjson cannot encode it (1e400 decoded as inf): the caller
-- parks the envelope, before it has written anything for it.
local function stamped(md, key, iso, occ)
  md['scheduler'] = key
  md['scheduleNext'] = iso
  if occ then md['scheduleOccurrence'] = occ end
  local ok, json = pcall(cjson.encode, md)
  if not ok then return nil, 'metadata: ' .. tostring(json) end
  return json
end

-- The scheduleOccurrence an envelope's messages carry for the occurrence whose
-- nominal time is `nom` (epoch ms, a decimal string): nil for a subscriber retry
-- (kind 2), whose messages keep the one their first delivery carried.
local function occurrence(env, nom)
  if env.kind == 2 then return nil end
  local ms = tonumber(nom)
  -- (Written so that NaN, from a ref written by hand, fails too.)
  if not (ms and ms >= 0 and ms <= MAX_INSTANT_MS) then return nil end
  return iso_ms(ms)
end

-- Takes the due candidate c = {stream id, due, bucket} into the batch and decides it:
--   nil                                    the batch is full (work or bytes): c is not taken;
--   false                                  taken and settled here (gone, undecodable: parked,
--                                          orphaned, waiting for REFILL, expired);
--   env, key, attempt, iso, next_due,      taken: the caller appends (FIRE) or claims (CLAIM)
--   occ, nnom, nom                         it; next_due nil = the last occurrence, iso = the
--                                          scheduleNext its messages carry, occ = their
--                                          scheduleOccurrence (nil: a retry's own), nnom = the
--                                          next occurrence's nominal ms ('-': next_due), nom =
--                                          this one's nominal ms (its `fired` record's `occ`).
-- `busy`: the batch already holds something (the first envelope always goes).
local function decide(c, now, max_entries, max_bytes, busy)
  local id, due = c[1], c[2]
  local env, why = read_envelope(id)
  if not env then
    B.taken[#B.taken + 1] = c
    if why == 'gone' then
      -- Deleted from the delayed topic by something else than the engine (an
      -- XTRIM, another client's MAXLEN, a release that did not know the moved
      -- hash): lost, but not silently, and once: its index entry goes with this
      -- record, so it is never listed as pending again.
      B.gone = B.gone + 1
      forget_move(id)
      hist('lost', id, '', '', 0, due, '', '', 1, 'EnvelopeGone', '')
    else
      park(id, nil, id, due, why)
    end
    return false
  end
  local n = #env.entries
  if env.source ~= '' then n = 1 end
  local cost = n + math.floor(env.pairs / METADATA_PER_ENTRY)
  if busy and (B.work + cost > max_entries or B.bytes + env.raw > max_bytes) then return nil end
  B.work, B.bytes = B.work + cost, B.bytes + env.raw
  B.unchecked = B.unchecked + cost - 1 + math.floor(env.raw / 65536)
  B.taken[#B.taken + 1] = c
  local key = id
  if env.sid ~= '' then key = env.sid end
  local attempt = math.max(env.attempt, 1)
  local iso, next_due, nom, nnom = 'purge', nil, due, '-'
  if env.kind == 1 then
    local step, nxt, niso, snom, snnom = recurring_step(env, id, key, due, now)
    if step == 'orphan' then
      -- An envelope nothing refers to any more: nothing to fire, nothing to keep.
      B.deletes[#B.deletes + 1] = id
      return false
    elseif step == 'wait' then
      return false
    end
    iso, next_due, nom, nnom = niso, nxt, snom, snnom
  end
  if env.expires > 0 and env.expires <= now then
    forget(id, env, key)
    hist('expired', key, env.sid, env.topic, env.kind, due, '', env.size, attempt, 'MaxAge', env.schedule)
    B.expired[#B.expired + 1] = key
    B.expired[#B.expired + 1] = env.topic
    return false
  end
  return env, key, attempt, iso, next_due, occurrence(env, nom), nnom, nom
end

-- Takes the batch's candidates out of the index and deletes its dropped stream entries.
local function batch_finish()
  remove_candidates(B.taken)
  delete_envelopes(B.deletes)
end
