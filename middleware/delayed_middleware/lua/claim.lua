-- CLAIM: phase 1 of the two-phase fire (Redis Cluster), in the shard's slot.
-- KEYS: 1 delayed stream, 2 index top, 3 ids hash, 4 bucket seq, 5 pending count,
--       6 history, 7 parked, 8 call tokens, 9 refill, 10 outbox,
--       11 in-flight zset (member envelope id, score lease expiry ms),
--       12 claims hash (envelope id -> "<due ms> <next due ms | -> <scheduleNext> <scheduler>"),
--       13 moved hash (moved.lua)
-- ARGV: 1 bucket key prefix, 2 now ms ('' = Redis TIME, as FIRE's), 3 max envelopes, 4 max work (as FIRE's: entries,
--       plus one per METADATA_PER_ENTRY metadata pairs), 5 max envelope bytes,
--       6 history maxlen (0 = off), 7 Redis time budget us (0 = none), 8 lease ms,
--       9 the firing component's name ('' = any): its trim applies only to
--       messages published through it (as FIRE's ARGV[10])
-- Returns {head, pending, parked, refill, first, gone, now, x, then x (id, topic)
-- pairs, n, then n claims}: head = the earliest due time left in the index or
-- lease end in flight ('' none); first = the earliest due time claimed ('' none);
-- gone = index entries whose envelope someone else deleted; now = the time the
-- batch was decided at (ms; leases are measured on it); the pairs are the
-- envelopes that expired unfired (for the caller's markers, as FIRE's); each
-- claim is 13 values then its entries: envelope id, occurrence due ms,
-- scheduler (the envelope's key), scheduleNext, scheduleOccurrence ('' for a
-- subscriber retry: its entries keep their own), append key (the target topic,
-- or the outbox with a targetPubsub), targetPubsub, topic, bulk (0/1),
-- expiresAt ms (0 none), scheduleSource (the client reads it: another slot),
-- trim (1: the caller's trim applies, 0: published through another component),
-- entry count k; then k triples data, metadata JSON (scheduler/scheduleNext/
-- scheduleOccurrence set), contentType.
--
-- The same decisions as FIRE up to the append, in the same code (batch.lua's
-- decide): a gone or undecodable envelope leaves the index (parked when
-- undecodable); an expired one is forgotten ('expired' record); a cron one whose
-- next due time is unknown or passed waits for REFILL; a reserved target parks. What FIRE would
-- append instead moves from the index to the in-flight set with a lease, in
-- this one atomic step, so no other replica claims it while the lease runs.
-- In-flight entries whose lease ended (their replica died or stalled) are
-- claimed again first, with a new lease: the caller re-runs APPEND (the fire
-- markers make repeats no-ops) and RELEASE. The target's type is checked by
-- APPEND, in the target's slot.
local STREAM, INDEX_TOP, IDS, BUCKET_SEQ, PENDING, HISTORY, PARKED, CALLS, REFILL_SET, OUTBOX =
  KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6], KEYS[7], KEYS[8], KEYS[9], KEYS[10]
local INFLIGHT, CLAIMS = KEYS[11], KEYS[12]
local MOVED = KEYS[#KEYS]
local BUCKET_PREFIX, NOW_ARG, MAX_ENVELOPES, MAX_WORK, MAX_BYTES, HIST_LEN, BUDGET_US, LEASE_MS, OWN_PUBSUB =
  ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6], ARGV[7], ARGV[8], ARGV[9]
--!include index.lua
--!include decode.lua
--!include history.lua
--!include common.lua
--!include batch.lua
--!include inflight.lua
local now = decision_now(NOW_ARG)
HIST_MAXLEN, HIST_NOW = tonumber(HIST_LEN), string.format('%.0f', now)
local max_env, max_entries, max_bytes = tonumber(MAX_ENVELOPES), tonumber(MAX_WORK), tonumber(MAX_BYTES)
local lease = tonumber(LEASE_MS)
local own_pubsub = OWN_PUBSUB or ''
local first = nil
local out, n = {}, 0
batch_start(tonumber(BUDGET_US))

-- One claim's reply record, or nil and why (metadata cjson cannot encode,
-- e.g. 1e400 decoded as inf: FIRE parks such an envelope, so CLAIM does too).
local function record(id, due, env, key, iso, occ)
  local target = OUTBOX
  if env.target == '' then target = env.topic end
  local expires = env.expires
  if env.sttl > 0 then expires = now + env.sttl end
  local entries = env.entries
  if env.source ~= '' then entries = {} end
  local trim = (env.target == '' and (own_pubsub == '' or env.pubsub == own_pubsub)) and 1 or 0
  local rec = {
    id, due, key, iso, occ or '', target, env.target, env.topic, env.bulk and 1 or 0, expires, env.source, trim, #entries,
  }
  for _, e in ipairs(entries) do
    local json, why = stamped(e[2], key, iso, occ)
    if not json then return nil, why end
    rec[#rec + 1] = e[1]
    rec[#rec + 1] = json
    rec[#rec + 1] = e[3]
  end
  return rec
end

-- Appends one claim record to the reply.
local function emit(rec, due)
  for _, v in ipairs(rec) do out[#out + 1] = v end
  n = n + 1
  if first == nil or tonumber(due) < first then first = tonumber(due) end
end

-- The scheduleOccurrence of the claimed occurrence due at `due` of envelope `id`
-- (key `key`), as CLAIM stamped it: the ids ref keeps its nominal time until
-- RELEASE advances it (no nominal there: the due time itself).
local function claimed_occurrence(env, id, key, due)
  local nom = due
  local ref = redis.call('HGET', IDS, key)
  if ref then
    local rid, rdue, _, _, _, rnom = parse_ref(ref)
    if rid == id and rdue == due and rnom ~= '-' then nom = rnom end
  end
  return occurrence(env, nom)
end

-- 1. Claims whose lease ended: taken over first, with their recorded occurrence.
local expired = redis.call('ZRANGEBYSCORE', INFLIGHT, '-inf', now, 'LIMIT', 0, max_env)
local withdrawn = {
  target = '', topic = '', expires = 0, sttl = 0, source = '', entries = {}, bulk = false, size = 0, pubsub = '',
}
for _, id in ipairs(expired) do
  if B.work >= max_entries or B.bytes >= max_bytes then break end
  local rec = redis.call('HGET', CLAIMS, id)
  local env = read_envelope(id)
  redis.call('ZADD', INFLIGHT, now + lease, id)
  local r, due = nil, rec and string.match(rec, '^(%S+)') or '0'
  -- A torn record (written by hand) may name no due time, or no scheduler: read as
  -- they were, nil reached a command and every step raised here, before any due
  -- message was claimed: nothing on the shard fired any more. Nor a next time that
  -- is no instant ('inf': RELEASE put it in the index, and every step failed on it).
  if not tonumber(due) then due = '0' end
  local _, _, iso, key = read_claim(rec)
  if key and env then
    r = record(id, due, env, key, iso, claimed_occurrence(env, id, key, due))
    B.work = B.work + math.max(#env.entries, 1) + math.floor(env.pairs / METADATA_PER_ENTRY)
    B.bytes = B.bytes + env.raw
  end
  -- Withdrawn (cancelled, replaced) while in flight, or a torn record: the
  -- caller releases it with nothing to append (RELEASE parks an envelope with a torn record).
  emit(r or record(id, due, withdrawn, id, '-'), due)
end

-- 2. Due occurrences, decided as FIRE decides them (batch.lua).
for i, c in ipairs(due_candidates(now, max_env - n)) do
  if out_of_time(i) then break end
  local id, due = c[1], c[2]
  local env, key, _, iso, next_due, occ = decide(c, now, max_entries, max_bytes, n > 0 or #B.taken > 0)
  if env == nil then break end
  if env then
    local bad, r = nil, nil
    if env.target == '' then bad = reserved(env.topic) end
    if not bad then r, bad = record(id, due, env, key, iso, occ) end
    if bad then
      park(id, env, key, due, bad)
    else
      redis.call('ZADD', INFLIGHT, now + lease, id)
      redis.call('HSET', CLAIMS, id, due .. ' ' .. (next_due or '-') .. ' ' .. iso .. ' ' .. key)
      emit(r, due)
    end
  end
end
batch_finish()
local h = next_wakeup()
local pending = tonumber(redis.call('GET', PENDING) or '0')
-- Refills overdue (due now, successor unknown), reported so whichever replica fires next completes them (as FIRE).
local refill = redis.call('ZCOUNT', REFILL_SET, '-inf', now)
local reply = {h or '', pending, B.parked, refill, first and tostring(first) or '', B.gone, string.format('%.0f', now),
  #B.expired / 2}
for _, v in ipairs(B.expired) do reply[#reply + 1] = v end
reply[#reply + 1] = n
for _, v in ipairs(out) do reply[#reply + 1] = v end
return reply
