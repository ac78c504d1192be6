-- FIRE: deliver what is due, exactly once, failure-atomic.
-- KEYS: 1 delayed stream, 2 index top, 3 ids hash, 4 bucket seq, 5 pending count,
--       6 history, 7 parked, 8 call tokens, 9 refill, 10 outbox, 11 moved hash (moved.lua)
-- ARGV: 1 bucket key prefix, 2 now ms ('' = the Redis server's TIME: common.lua decision_now), 3 max envelopes, 4 max work (entries appended, plus
--       one per METADATA_PER_ENTRY metadata pairs decoded), 5 max envelope bytes,
--       6 trim mode ('' | 'MAXLEN' | 'MINID' | 'MINAGE': MINID at now - ARGV[7]), 7 trim threshold, 8 history maxlen (0 = off),
--       9 time budget us (0 = none), 10 the firing component's name ('' = any): its
--       trim applies only to messages published through it
-- Returns {fired, head, first, pending, parked, refill, entries, gone, now, x, ...}: envelopes fired;
-- the earliest due time left ('' when none); the earliest due time fired ('' when
-- none); messages left in the index; envelopes parked; recurring envelopes whose
-- refill is overdue (due now, successor unknown: any replica completes them);
-- entries appended; index entries whose envelope someone else deleted from the
-- delayed topic; the time the batch was decided at (ms); then x (envelope id, topic) pairs of the envelopes that expired
-- unfired; then the rest: common.lua's REFILLS quads for this batch's cron envelopes.
--
-- Why exactly once: an occurrence leaves the index (or, recurring, moves to its
-- next due time) in the same atomic step that appends it to its target, so a
-- second replica, a retry after a crash, or a replay finds nothing to do.
-- Why failure-atomic: every append to a target is a pcall and targets are
-- checked first (type, reserved namespace); an envelope that cannot be
-- delivered is parked (kept on the delayed topic, listed in PARKED, recorded
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
-- REFILL_SET for a REFILL and fire once afterwards: never a storm of missed occurrences.
-- Target topics are not in KEYS: fine on a single node; Redis Cluster uses the
-- two-phase variant of the same steps.
local STREAM, INDEX_TOP, IDS, BUCKET_SEQ, PENDING, HISTORY, PARKED, CALLS, REFILL_SET, OUTBOX =
  KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6], KEYS[7], KEYS[8], KEYS[9], KEYS[10]
local MOVED = KEYS[#KEYS]
local BUCKET_PREFIX, NOW_ARG, MAX_ENVELOPES, MAX_WORK, MAX_BYTES, TRIM_MODE, TRIM_AT, HIST_LEN, BUDGET_US, OWN_PUBSUB =
  ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6], ARGV[7], ARGV[8], ARGV[9], ARGV[10]
--!include index.lua
--!include decode.lua
--!include history.lua
--!include common.lua
--!include batch.lua
local now = decision_now(NOW_ARG)
-- FIRE adds no moves (it only forgets them): with none at the start, every
-- envelope is read at its own id, with no HGET each.
MOVED_NONE = redis.call('EXISTS', MOVED) == 0
HIST_MAXLEN, HIST_NOW = tonumber(HIST_LEN), string.format('%.0f', now)
-- A record per fired message: the history is trimmed once, at the end (history.lua).
HIST_TRIM_AT_END = true
local max_env, max_entries, max_bytes = tonumber(MAX_ENVELOPES), tonumber(MAX_WORK), tonumber(MAX_BYTES)
local trim_mode, trim_at = TRIM_MODE, TRIM_AT
-- MINAGE: streamTTL with the threshold on this decision's time (Redis TIME
-- unless the clock is authoritative): topic ids come from Redis's clock.
if trim_mode == 'MINAGE' then trim_mode, trim_at = 'MINID', string.format('%.0f-1', now - tonumber(trim_at)) end
local fired, appended, first = 0, 0, nil
-- Recurring envelopes re-enter the index only after the batch's removals
-- (batch_finish), else their ids would be removed again with their old bucket's.
local reinserts = {}
-- Several components of one app (same consumerID) share the delayed topic and
-- fire each other's messages: a topic is trimmed by the settings of the
-- component it was published through, never by another's maxLenApprox.
local own_pubsub = OWN_PUBSUB or ''
batch_start(tonumber(BUDGET_US or '0'))

--!include target_append.lua

-- Candidates are read as the batch reaches them (due_iter), not all up front,
-- and their envelopes a span at a time (common.lua's read_ahead).
AHEAD = {}
local i = 0
-- The candidate in hand until something of it is appended (false then, or once
-- it is done with), and the lengths of B.taken, B.deletes and reinserts before decide() took it.
local held, held_taken, held_deletes, held_reinserts = false, 0, 0, 0
-- The batch's walk. What it leaves to the end (index removals, deletes,
-- reinserts, the history's trim) is done even when it raises midway, as far as
-- it got (Redis keeps what a script wrote before its error): a message appended
-- and left in the index, or its envelope on the stream, would fire again. A
-- candidate not yet appended when it raised stays where it was, for the next step.
local function fire_all()
  for c in due_iter(now, max_env, read_ahead) do
    i = i + 1
    if out_of_time(i) then break end
    held, held_taken, held_deletes, held_reinserts = true, #B.taken, #B.deletes, #reinserts
    local id, due = c[1], c[2]
    local env, key, attempt, iso, next_due, occ, nnom, nom = decide(c, now, max_entries, max_bytes, #B.taken > 0)
    if env == nil then break end
    if env then
      -- The outbox is our own stream; a topic must be a stream (or not exist yet).
      local target, bad = OUTBOX, nil
      if env.target == '' then
        target = env.topic
        bad = bad_target(target)
      end
      if bad then
        park(id, env, key, due, bad)
      else
        local done, failed = append(env, key, iso, occ, target)
        -- Something went out: from here on it is finished, whatever raises.
        if done > 0 then held = false end
        appended = appended + done
        if failed and done == 0 then
          park(id, env, key, due, failed)
        else
          if next_due == nil then
            forget(id, env, key)
          else
            reinserts[#reinserts + 1] = {id, next_due}
            advance(env, id, key, next_due, nnom)
          end
          if first == nil or tonumber(due) < first then first = tonumber(due) end
          local lateness = now - tonumber(due)
          hist('fired', key, env.sid, env.topic, env.kind, due, lateness, env.size, attempt, failed or '', env.schedule,
            nom)
          -- A recurring schedule's last occurrence (its end or limit reached): its own record.
          if next_due == nil and env.kind == 1 then completed(key, env, due, attempt) end
          fired = fired + 1
        end
      end
    end
    held = false
  end
end
local ok, err = pcall(fire_all)
if not ok and held then
  for _, t in ipairs({{B.taken, held_taken}, {B.deletes, held_deletes}, {reinserts, held_reinserts}}) do
    for k = #t[1], t[2] + 1, -1 do t[1][k] = nil end
  end
end
batch_finish()
insert_many(reinserts)
hist_trim()
if not ok then error(err, 0) end
local pending = tonumber(redis.call('GET', PENDING) or '0')
-- Refills nobody completed (occurrences already due whose successor nobody
-- computed: their replica stopped between its FIRE and its REFILL, or they
-- waited above), reported so that whichever replica fires next completes them.
local refill = redis.call('ZCOUNT', REFILL_SET, '-inf', now)
local out = {fired, head() or '', first and tostring(first) or '', pending, B.parked, refill, appended, B.gone,
  string.format('%.0f', now), #B.expired / 2}
for _, v in ipairs(B.expired) do out[#out + 1] = v end
for _, v in ipairs(REFILLS) do out[#out + 1] = v end
return out
