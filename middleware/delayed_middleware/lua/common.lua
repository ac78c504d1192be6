-- LIBRARY common.lua: envelope bookkeeping shared by the engine's scripts.
-- Needs index.lua, decode.lua and history.lua included before it.
-- Expects the including script's locals STREAM (delayed stream), IDS (ids hash),
-- PARKED (parked hash), REFILL_SET (refill zset) and MOVED (moved hash).
--!include moved.lua

-- The time a fire decision is made at, in epoch ms: `arg` from an injected
-- (authoritative) clock, or, when '', the Redis server's clock: the one clock
-- every replica of this shard shares, so a replica whose own clock runs ahead
-- never fires early and one that runs behind never fires late.
local function decision_now(arg)
  if arg ~= nil and arg ~= '' then return tonumber(arg) end
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

-- Call tokens (SCHEDULE's) and trigger identities (TIMECONTROL's) share one sorted set
-- scored by the Redis clock: forget those older than `window_ms`, at most `most` per call
-- (more than the call adds, so the set cannot grow under steady load).
local function forget_tokens(calls, server_ms, window_ms, most)
  local old = redis.call('ZCOUNT', calls, '-inf', server_ms - window_ms)
  if old > 0 then redis.call('ZREMRANGEBYRANK', calls, 0, math.min(old, most) - 1) end
end

-- Envelopes read ahead by read_ahead (stream id -> the entry's fields), or nil
-- when read-ahead is off (the default; FIRE turns it on); what it read and
-- how many of those were used, so it turns itself off where it does not pay.
local AHEAD, AHEAD_READ, AHEAD_USED = nil, 0, 0

-- Reads the envelopes of these candidates ({stream id, ...}) with one XRANGE
-- over their span, instead of one XRANGE each (~1 us an entry against ~3):
-- envelopes due together were mostly stored together (a bulk publish, a
-- steady stream), but the index hands them out in string order ("-10" before
-- "-9"), so the span is read in stream order and whatever else it holds is
-- kept for the candidates that follow. Only while no envelope is moved (ids
-- are where they are stored), and off for the rest of the call once it has
-- read more than twice what was used (envelopes due together but stored far
-- apart): then each envelope is read alone, as before.
local function read_ahead(cs)
  if not AHEAD or not MOVED_NONE then return end
  if AHEAD_READ > 2 * AHEAD_USED + 256 then
    AHEAD = nil
    return
  end
  local lo, hi, lo_ms, lo_seq, hi_ms, hi_seq, n = nil, nil, 0, 0, 0, 0, 0
  for _, c in ipairs(cs) do
    local id = c[1]
    if AHEAD[id] == nil then
      local ms, seq = string.match(id, '^(%d+)%-(%d+)$')
      -- (Past 19 digits XRANGE may refuse it: read_envelope's is_stream_id.)
      if ms and #ms <= 19 and #seq <= 19 then
        ms, seq = tonumber(ms), tonumber(seq)
        n = n + 1
        if not lo or ms < lo_ms or (ms == lo_ms and seq < lo_seq) then lo, lo_ms, lo_seq = id, ms, seq end
        if not hi or ms > hi_ms or (ms == hi_ms and seq > hi_seq) then hi, hi_ms, hi_seq = id, ms, seq end
      end
    end
  end
  if n < 2 then return end
  local got = redis.call('XRANGE', STREAM, lo, hi, 'COUNT', math.min(2 * n, 256))
  AHEAD_READ = AHEAD_READ + #got
  for _, e in ipairs(got) do
    if AHEAD[e[1]] == nil then AHEAD[e[1]] = e[2] end
  end
end

-- Whether digits `d` are below 2^64 (18446744073709551615 at most; leading zeros as Redis reads them).
local function below_2_64(d)
  d = string.match(d, '^0*(%d+)$')
  if #d ~= 20 then return #d < 20 end
  local hi, lo = tonumber(string.sub(d, 1, 10)), tonumber(string.sub(d, 11))
  return hi < 1844674407 or (hi == 1844674407 and lo <= 3709551615)
end

-- Whether `v` is a stream id as XRANGE takes it (ms-seq, each below 2^64, at most 127 bytes).
-- Not 19 digits at most: once the stream holds an id past 10^19 ms, every id XADD makes there
-- is one too, and a move to it taken for no stream id lost the envelope.
local function is_stream_id(v)
  local ms, seq = string.match(v, '^(%d+)%-(%d+)$')
  return ms ~= nil and #v <= 127 and below_2_64(ms) and below_2_64(seq)
end

-- The envelope stored at stream id `id`, decoded, or nil (gone or undecodable) and why.
-- An index member or a move written by hand may name no stream id at all, which XRANGE
-- refuses (ms-seq, each below 2^64): raised before any write, at the same candidate
-- in every step, that blocked the shard's firing. Such a member names no envelope
-- (gone); such a move is forgotten and the envelope read where it was stored first.
local function read_envelope(id)
  local f = AHEAD and AHEAD[id]
  if f then
    AHEAD[id] = false
    AHEAD_USED = AHEAD_USED + 1
  else
    local at = stored_at(id)
    if at ~= id and not is_stream_id(at) then
      forget_move(id)
      at = id
    end
    -- Checked only once XRANGE refused it: the pcall costs nothing, the check ~0.3 us a read.
    -- Refused for another reason (the stream is not one), it raises as it did, unchanged.
    local ok, got = pcall(redis.call, 'XRANGE', STREAM, at, at)
    if not ok then
      if is_stream_id(at) then redis.call('XRANGE', STREAM, at, at) end
      return nil, 'gone'
    end
    local e = got[1]
    if not e then return nil, 'gone' end
    f = e[2]
  end
  for j = 1, #f, 2 do
    if f[j] == 'data' then
      local ok, env = pcall(decode, f[j + 1])
      if ok then return env, '' end
      return nil, 'undecodable: ' .. tostring(env)
    end
  end
  return nil, 'undecodable: no data field'
end

-- Withdraws everything of the envelope an ids-hash ref points to (index entry,
-- stream entry, refill and parked marks); the ids entry itself is the caller's.
local function drop_ref(key, ref)
  local sid, due, _, _, flag = parse_ref(ref)
  -- A ref without a numeric due (written by hand) names no index entry: locating it would raise.
  if flag ~= 'u' and tonumber(due) then remove(sid, due) end
  delete_envelopes({sid})
  redis.call('ZREM', REFILL_SET, key)
  redis.call('HDEL', PARKED, sid)
  return sid, due
end

-- Epoch ms as RFC 3339 UTC with milliseconds, byte-equal to instants.format_instant
-- (Hinnant's days-to-civil; floors, so years before 1970 work too). `ms` is an
-- integral number within years 0001-9999 (exact as a double: < 2^53).
-- The last one is kept: a burst of occurrences due at one instant formats it once.
local ISO_LAST_MS, ISO_LAST = nil, nil
local function iso_ms(ms)
  if ms == ISO_LAST_MS then return ISO_LAST end
  local floor = math.floor
  local days = floor(ms / 86400000)
  local rem = ms - days * 86400000
  local z = days + 719468
  local era = floor(z / 146097)
  local doe = z - era * 146097
  local yoe = floor((doe - floor(doe / 1460) + floor(doe / 36524) - floor(doe / 146096)) / 365)
  local doy = doe - (365 * yoe + floor(yoe / 4) - floor(yoe / 100))
  local mp = floor((5 * doy + 2) / 153)
  local d = doy - floor((153 * mp + 2) / 5) + 1
  local m = mp < 10 and mp + 3 or mp - 9
  local y = yoe + era * 400
  if m <= 2 then y = y + 1 end
  local s = floor(rem / 1000)
  ISO_LAST_MS, ISO_LAST = ms, string.format('%04d-%02d-%02dT%02d:%02d:%02d.%03dZ',
    y, m, d, floor(s / 3600), floor(s / 60) % 60, s % 60, rem % 1000)
  return ISO_LAST
end

-- The last instant formatable (instants.MAX_INSTANT_MS, 9999-12-31T23:59:59.999Z).
local MAX_INSTANT_MS = 253402300799999

-- Whether `v` reads as an instant (epoch ms, years up to 9999): not NaN, nor 'inf' (which
-- Redis takes as a score: an index entry at infinity, whose time the engine cannot read).
local function is_instant(v)
  local x = tonumber(v)
  return x ~= nil and math.abs(x) <= MAX_INSTANT_MS
end

-- An @every envelope's first grid point (published + k * every, k >= 1) strictly after
-- `after`, as a decimal string, or nil past year 9999 (the schedule ends). Same
-- arithmetic as schedules.next_fire: computed from the start, so no drift.
local function every_after(env, after)
  local start, every = env.published, env.every
  local k = math.max(1, math.floor((after - start) / every) + 1)
  local nxt = start + k * every
  if nxt > MAX_INSTANT_MS then return nil end
  -- '%.0f', not tostring: Lua prints numbers with 14 significant digits.
  return string.format('%.0f', nxt)
end

-- The catch-up policies (DelayedMessage.scheduleCatchup, schedules.Catchup) and the
-- window's default (schedules.DEFAULT_CATCHUP_WINDOW_MS).
local CATCHUP_ALL, CATCHUP_NONE = 1, 2
local DEFAULT_CATCHUP_WINDOW_MS = 86400000

-- The recurring decision FIRE and CLAIM share, for envelope `id` (ids-hash key
-- `key`) whose occurrence due at `due` is being fired at `now`:
--   'orphan'                   nothing refers to it any more (replaced or cancelled): drop it unfired;
--   'wait'                     its successor is unknown, or has passed too (missed fires): it leaves
--                              the index for the refill set (REFILL_SET) and REFILL (engine/refill.py)
--                              applies the schedule's catch-up policy before it fires, or not;
--   'fire', nxt, iso, nom, nn  fire it; nxt = the next due ms (nil: this is the last occurrence),
--                              iso = the scheduleNext its messages carry ('purge' with nil), nom =
--                              this occurrence's nominal ms (its scheduleOccurrence), nn = the
--                              next one's nominal ('-': the same as nxt).
-- An @every envelope without jitter or bounds is advanced here: its successor is the first
-- grid point after max(due, now), so after an outage the overdue occurrence fires once and
-- the schedule goes on from now on its grid (catch-up `one`). When its successor has passed
-- too and it catches up otherwise (`none`, or `one` past its window) it waits for REFILL as a
-- cron one does; with `all` it is advanced by REFILL like a cron one (one occurrence at a time).
local function recurring_step(env, id, key, due, now)
  local ref = redis.call('HGET', IDS, key)
  if not ref or parse_ref(ref) ~= id then return 'orphan' end
  local _, rdue, rnext, riso, _, rnom, rnnom = parse_ref(ref)
  local nom = due
  -- The ref's nominal is this occurrence's only while the ref names this due time.
  if rnom ~= '-' and rdue == due then nom = rnom end
  if env.every > 0 and env.catchup ~= CATCHUP_ALL then
    local d = tonumber(due)
    local window = env.cwindow > 0 and env.cwindow or DEFAULT_CATCHUP_WINDOW_MS
    local missed = d + env.every <= now
    if not (missed and (env.catchup == CATCHUP_NONE or now - tonumber(nom) > window)) then
      local nxt = every_after(env, math.max(d, now))
      if nxt == nil then return 'fire', nil, 'purge', nom, '-' end
      return 'fire', nxt, iso_ms(tonumber(nxt)), nom, '-'
    end
    rnext = '-'
  end
  -- A ref written by hand may lack a numeric due or next: this occurrence's due
  -- stands in, and an unreadable next waits for REFILL (no nil may reach a command).
  -- Nor a time that is no instant: tonumber reads 'nan', 'inf' and '1e999', which
  -- Redis then refuses as a score (ZADD), after this batch's appends: a next of
  -- them stopped the schedule for good, a due of them blocked the shard's firing.
  if not is_instant(rdue) then rdue = due end
  local rn = tonumber(rnext)
  if rn and not is_instant(rnext) then rn = nil end
  if rnext == '-' or (rnext ~= 'purge' and (not rn or rn <= now)) then
    redis.call('HSET', IDS, key, make_ref(id, rdue, '-', '-', 'u', rnom, '-'))
    redis.call('ZADD', REFILL_SET, rdue, key)
    return 'wait'
  end
  if rnext == 'purge' then return 'fire', nil, 'purge', nom, '-' end
  return 'fire', rnext, riso, nom, rnnom
end

-- The cron envelopes advance() marked, as sextets (ids key, its new ref, schedule
-- expression, acceptance ms, catch-up policy, its window ms): the script returns them, so the calling replica
-- computes each successor and REFILLs them at once, with no reads of its own.
local REFILLS = {}

-- After an occurrence fired: the envelope's ref points at its next due time `nxt`
-- (the caller re-indexes it there), whose nominal time is `nnom` ('-' or nil: nxt
-- itself). A cron envelope (or an @every one catching up `all`) also enters the refill set,
-- scored by when its successor is needed, and is listed in REFILLS; if the
-- replica does not REFILL it (it died), whichever replica fires next finds it
-- there. An @every one needs none. Returns 1 if it was marked for refill, else 0.
local function advance(env, id, key, nxt, nnom)
  local ref = make_ref(id, nxt, '-', '-', 'i', nnom, '-')
  redis.call('HSET', IDS, key, ref)
  if env.every > 0 and env.catchup ~= CATCHUP_ALL then return 0 end
  redis.call('ZADD', REFILL_SET, nxt, key)
  local n = #REFILLS
  REFILLS[n + 1], REFILLS[n + 2], REFILLS[n + 3] = key, ref, env.schedule
  REFILLS[n + 4] = string.format('%.0f', env.published)
  REFILLS[n + 5], REFILLS[n + 6] = env.catchup, string.format('%.0f', env.cwindow)
  return 1
end
