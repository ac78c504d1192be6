-- FIRE: deliver what is due, exactly once, failure-atomic.
-- KEYS: 1 delayed stream, 2 index top, 3 ids hash, 4 bucket seq, 5 pending count,
--       6 history, 7 parked, 8 call tokens, 9 refill, 10 outbox
-- ARGV: 1 bucket key prefix, 2 now ms, 3 max envelopes, 4 max work (entries appended, plus
--       one per METADATA_PER_ENTRY metadata pairs decoded), 5 max envelope bytes,
--       6 trim mode ('' | 'MAXLEN' | 'MINID'), 7 trim threshold, 8 history maxlen (0 = off),
--       9 time budget us (0 = none), 10 the firing component's name ('' = any): its
--       trim applies only to messages published through it
-- Returns {fired, head, first, pending, parked, refill, entries, gone, x, ...}: envelopes fired;
-- the earliest due time left ('' when none); the earliest due time fired ('' when
-- none); messages left in the index; envelopes parked; recurring envelopes whose
-- refill is overdue (due now, successor unknown: any replica completes them);
-- entries appended; index entries whose envelope someone else deleted from the
-- delayed topic; then x (envelope id, topic) pairs of the envelopes that expired
-- unfired; then the rest: common.lua's REFILLS quads for this batch's cron envelopes.
--
-- Why exactly once: an occurrence leaves the index (or, recurring, moves to its
-- next due time) in the same atomic step that appends it to its target, so a
-- second replica, a retry after a crash, or a replay finds nothing to do.
-- Why failure-atomic: every append to a target is a pcall and targets are
-- checked first (type, reserved namespace); an envelope that cannot be
-- delivered is parked (kept on the delayed topic, listed in KEYS[7], recorded
-- in the history) and the rest of the batch fires. Redis does not roll a
-- script back, so nothing here may raise after the first write.
-- Bounded: a batch stops before max work or max bytes, or once it has run
-- for the time budget (after at least one envelope), so one call never holds
-- Redis for long, however loaded the machine. Bytes are the stored envelope's,
-- metadata included, and metadata pairs count as work: an envelope with 10,000
-- metadata keys and an empty payload costs ~10 ms to decode and encode, and was
-- counted as one cheap entry. The clock is read every 8 cheap envelopes, and
-- after any costly one.
-- Recurring envelopes fire only when their next due time is known: @every ones
-- compute it here (common.lua's recurring_step); cron ones read it from their
-- ids ref, and when it is unknown or has passed too (missed fires) they wait in
-- KEYS[9] for a REFILL and fire once afterwards: never a storm of missed occurrences.
-- Target topics are not in KEYS: fine on a single node; Redis Cluster uses the
-- two-phase variant of the same steps.
--!include index.lua
--!include decode.lua
--!include history.lua
--!include common.lua
HIST_MAXLEN, HIST_NOW = tonumber(ARGV[8]), ARGV[2]
local now = tonumber(ARGV[2])
local max_env, max_entries, max_bytes = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
local trim_mode, trim_at = ARGV[6], ARGV[7]
local fired, parked, refill, appended, bytes, first = 0, 0, 0, 0, 0, nil
-- Decoding and encoding a metadata pair costs about a quarter of appending an entry.
local METADATA_PER_ENTRY = 4
local work, unchecked, gone = 0, 0, 0
local types = {}
-- Index removals and stream deletions are applied together at the end, and
-- recurring envelopes re-enter the index only after that (their ids would
-- otherwise be removed again with their old bucket's batch).
local taken, deletes, reinserts = {}, {}, {}
-- (id, topic) of each envelope that expired unfired, for the caller's markers.
local expired = {}
local budget_us = tonumber(ARGV[9] or '0')
-- Several components of one app (same consumerID) share the delayed topic and
-- fire each other's messages: a topic is trimmed by the settings of the
-- component it was published through, never by another's maxLenApprox.
local own_pubsub = ARGV[10] or ''
local function clock_us()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000000 + tonumber(t[2])
end
local started = budget_us > 0 and clock_us() or 0

-- Why `topic` cannot take our XADD, or nil.
local function bad_target(topic)
  if string.find(topic, '-delayed}', 1, true) then return 'reserved: an engine key' end
  if string.sub(topic, -8) == '-delayed' then return 'reserved: a delayed topic' end
  local t = types[topic]
  if t == nil then
    t = redis.call('TYPE', topic).ok
    types[topic] = t
  end
  if t ~= 'stream' and t ~= 'none' then return 'WRONGTYPE: the key is a ' .. t .. ', not a stream' end
  return nil
end

local function park(id, env, key, due, why)
  redis.call('HSET', KEYS[7], id, why)
  parked = parked + 1
  if env then
    hist('parked', key, env.sid, env.topic, env.kind, due, '', env.size, math.max(env.attempt, 1), why, env.schedule)
  else
    hist('parked', key, '', '', 0, due, '', '', 1, why, '')
  end
end

local function forget(id, env, key)
  deletes[#deletes + 1] = id
  if env.sid ~= '' or env.kind == 1 then
    local r = redis.call('HGET', KEYS[3], key)
    if r and parse_ref(r) == id then
      redis.call('HDEL', KEYS[3], key)
      redis.call('ZREM', KEYS[9], key)
    end
  end
end

-- The message a schedule with scheduleSource produces: the source topic's latest entry.
local function sampled(source)
  if bad_target(source) then return {} end
  local last = redis.call('XREVRANGE', source, '+', '-', 'COUNT', 1)[1]
  if not last then return {} end
  local data, md, ct = '', {}, ''
  local f = last[2]
  for j = 1, #f, 2 do
    if f[j] == 'data' then data = f[j + 1]
    elseif f[j] == 'contentType' then ct = f[j + 1]
    elseif f[j] == 'metadata' then
      -- Anyone writes the source: keep its metadata only if it encodes again
      -- (cjson decodes 1e400 as inf, then refuses to encode it), else drop it
      -- as a reader of a malformed entry does; the data still goes out.
      local ok, t = pcall(cjson.decode, f[j + 1])
      if ok and type(t) == 'table' and pcall(cjson.encode, t) then md = t end
    end
  end
  return {{data, md, ct}}
end

for i, c in ipairs(due_candidates(now, max_env)) do
  local id, due = c[1], c[2]
  if budget_us > 0 and i > 1 and unchecked >= 8 then
    if clock_us() - started > budget_us then break end
    unchecked = 0
  end
  unchecked = unchecked + 1
  local env, why = read_envelope(id)
  if not env then
    taken[#taken + 1] = c
    if why == 'gone' then
      -- Deleted from the delayed topic by something else than the engine (an
      -- XTRIM, another client's MAXLEN): lost, but not silently.
      gone = gone + 1
    else
      park(id, nil, id, due, why)
    end
  else
    local n = #env.entries
    if env.source ~= '' then n = 1 end
    local cost = n + math.floor(env.pairs / METADATA_PER_ENTRY)
    if #taken > 0 and (work + cost > max_entries or bytes + env.raw > max_bytes) then break end
    work, bytes = work + cost, bytes + env.raw
    unchecked = unchecked + cost - 1 + math.floor(env.raw / 65536)
    taken[#taken + 1] = c
    local key = id
    if env.sid ~= '' then key = env.sid end
    local attempt = math.max(env.attempt, 1)
    local iso, next_due, final, skip = 'purge', nil, true, false
    if env.kind == 1 then
      local step, nxt, niso = recurring_step(env, id, key, due, now)
      if step == 'orphan' then
        -- An envelope nothing refers to any more: nothing to fire, nothing to keep.
        deletes[#deletes + 1] = id
        skip = true
      elseif step == 'wait' then
        skip = true
      elseif nxt ~= nil then
        next_due, iso, final = nxt, niso, false
      end
    end
    if skip then
      -- handled above
    elseif env.expires > 0 and env.expires <= now then
      forget(id, env, key)
      hist('expired', key, env.sid, env.topic, env.kind, due, '', env.size, attempt, 'MaxAge', env.schedule)
      expired[#expired + 1] = key
      expired[#expired + 1] = env.topic
    else
      -- The outbox is our own stream; a topic must be a stream (or not exist yet).
      local target, bad = KEYS[10], nil
      if env.target == '' then
        target = env.topic
        bad = bad_target(target)
      end
      if bad then
        park(id, env, key, due, bad)
      else
        local entries = env.entries
        if env.source ~= '' then
          entries = sampled(env.source)
          -- The sampled message is anyone's size: it counts like the envelope's own.
          local got = entries[1] and #entries[1][1] or 0
          bytes = bytes + got
          unchecked = unchecked + math.floor(got / 65536)
        end
        local expires = env.expires
        if env.sttl > 0 then expires = now + env.sttl end
        local failed, done = nil, 0
        for _, entry in ipairs(entries) do
          local md = entry[2]
          md['scheduler'] = key
          md['scheduleNext'] = iso
          local args = {target}
          if env.target == '' and trim_mode ~= '' and (own_pubsub == '' or env.pubsub == own_pubsub) then
            args[2], args[3], args[4] = trim_mode, '~', trim_at
          end
          args[#args + 1] = '*'
          args[#args + 1] = 'data'
          args[#args + 1] = entry[1]
          -- Guarded like the XADD: nothing may raise after the first write.
          local encoded, json = pcall(cjson.encode, md)
          if not encoded then
            failed = 'metadata: ' .. tostring(json)
            break
          end
          args[#args + 1] = 'metadata'
          args[#args + 1] = json
          if entry[3] ~= '' then
            args[#args + 1] = 'contentType'
            args[#args + 1] = entry[3]
          end
          if expires > 0 then
            args[#args + 1] = 'expiresAt'
            args[#args + 1] = tostring(expires)
          end
          if env.target ~= '' then
            args[#args + 1] = 'pubsub'
            args[#args + 1] = env.target
            args[#args + 1] = 'topic'
            args[#args + 1] = env.topic
            args[#args + 1] = 'id'
            args[#args + 1] = key
            if env.bulk then
              args[#args + 1] = 'bulk'
              args[#args + 1] = key
            end
          end
          local ok, err = pcall(redis.call, 'XADD', unpack(args))
          if not ok then
            failed = tostring(err)
            break
          end
          done = done + 1
        end
        appended = appended + done
        if failed and done == 0 then
          park(id, env, key, due, failed)
        else
          if final then
            forget(id, env, key)
          else
            reinserts[#reinserts + 1] = {id, next_due}
            refill = refill + advance(env, id, key, next_due)
          end
          if first == nil or tonumber(due) < first then first = tonumber(due) end
          local lateness = now - tonumber(due)
          hist('fired', key, env.sid, env.topic, env.kind, due, lateness, env.size, attempt, failed or '', env.schedule)
          fired = fired + 1
        end
      end
    end
  end
end
remove_candidates(taken)
for i = 1, #deletes, 500 do
  redis.call('XDEL', KEYS[1], unpack(deletes, i, math.min(i + 499, #deletes)))
end
for _, r in ipairs(reinserts) do insert(r[1], r[2]) end
local pending = tonumber(redis.call('GET', KEYS[5]) or '0')
-- Refills nobody completed (occurrences already due whose successor nobody
-- computed: their replica stopped between its FIRE and its REFILL, or they
-- waited above), reported so that whichever replica fires next completes them.
refill = redis.call('ZCOUNT', KEYS[9], '-inf', now)
local out = {fired, head() or '', first and tostring(first) or '', pending, parked, refill, appended, gone, #expired / 2}
for _, v in ipairs(expired) do out[#out + 1] = v end
for _, v in ipairs(REFILLS) do out[#out + 1] = v end
return out
