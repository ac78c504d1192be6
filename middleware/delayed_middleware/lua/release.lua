-- RELEASE: phase 3 of the two-phase fire, in the shard's slot: finalize what
-- APPEND did, exactly as FIRE does after its append.
-- KEYS: 1 delayed stream, 2 index top, 3 ids hash, 4 bucket seq, 5 pending count,
--       6 history, 7 parked, 8 call tokens, 9 refill, 10 outbox, 11 in-flight zset, 12 claims hash,
--       13 moved hash (moved.lua)
-- ARGV: 1 bucket key prefix, 2 now ms ('' = Redis TIME, as FIRE's), 3 history maxlen (0 = off), 4 n, then n
--       pairs: envelope id, outcome ('ok' | 'dup': appended; anything else: the
--       reason it could not be, and the envelope parks)
-- Returns {released, parked, refill, fired, head, ...}: refill = envelopes marked for
-- REFILL; head as CLAIM's, after this release; then common.lua's REFILLS quads.
--
-- Only the call that removes the envelope from the in-flight set acts on it
-- (ZREM returns 1 once), so a slow replica releasing after the one that took
-- its lease over changes nothing, and each occurrence gets one 'fired' record.
-- A one-shot envelope leaves the stream and the ids hash; a recurring one goes
-- back into the index at its next due time (precomputed, recorded at CLAIM);
-- a cron one waits for REFILL to learn the one after, as FIRE leaves it.
local STREAM, INDEX_TOP, IDS, BUCKET_SEQ, PENDING, HISTORY, PARKED, CALLS, REFILL_SET, OUTBOX =
  KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6], KEYS[7], KEYS[8], KEYS[9], KEYS[10]
local INFLIGHT, CLAIMS = KEYS[11], KEYS[12]
local MOVED = KEYS[#KEYS]
local BUCKET_PREFIX, NOW_ARG, HIST_LEN, N_OUTCOMES =
  ARGV[1], ARGV[2], ARGV[3], ARGV[4]
--!include index.lua
--!include decode.lua
--!include history.lua
--!include common.lua
--!include inflight.lua
local now = decision_now(NOW_ARG)
HIST_MAXLEN, HIST_NOW = tonumber(HIST_LEN), string.format('%.0f', now)
-- A record per released message: the history is trimmed once, at the end (history.lua).
HIST_TRIM_AT_END = true
local released, parked, refill, fired = 0, 0, 0, 0
-- Recurring envelopes re-enter the index together at the end (index.lua insert_many).
local reinserts = {}
-- Stream entries of the envelopes done with, deleted together at the end.
local deletes = {}
-- One outcome after the other; what they leave to the end (reinserts, deletes, the
-- history's trim) is done even when one raises midway (Redis keeps what a script
-- wrote before its error): a released envelope left on the stream would be found
-- by RECOVER as an orphan and fired again once its fire marker expired.
local function release_all()
  local pos = 5
  for _ = 1, tonumber(N_OUTCOMES) do
    local id, outcome = ARGV[pos], ARGV[pos + 1]
    pos = pos + 2
    if redis.call('ZREM', INFLIGHT, id) == 1 then
      local rec = redis.call('HGET', CLAIMS, id)
      redis.call('HDEL', CLAIMS, id)
      local env, why = read_envelope(id)
      if why == 'gone' then forget_move(id) end
      if rec and env then
        local due, next_due, _, key = read_claim(rec)
        if not key then
          -- A torn claim record (written by hand; or its next time no instant, which would go into
          -- the index at 'inf', or raise): which occurrence was claimed is unknown (CLAIM's
          -- takeover appends nothing for it). The envelope parks: kept, listed, recorded, never
          -- appended again (also when a stalled replica appended it before the record tore).
          due, key, outcome = string.match(rec, '^%S*'), env.sid ~= '' and env.sid or id, 'torn claim record'
        end
        local attempt = math.max(env.attempt, 1)
        if outcome ~= 'ok' and outcome ~= 'dup' then
          redis.call('HSET', PARKED, id, outcome)
          parked = parked + 1
          hist('parked', key, env.sid, env.topic, env.kind, due, '', env.size, attempt, outcome, env.schedule)
        else
          local ref = nil
          if env.sid ~= '' or env.kind == 1 then ref = redis.call('HGET', IDS, key) end
          local current = ref and parse_ref(ref) == id
          -- The occurrence's nominal time for its `fired` record, as CLAIM stamped it (the ref's
          -- while it names this due time; else the due time itself), read before advance() moves it.
          local nom = due
          if current then
            local _, rdue, _, _, _, rnom = parse_ref(ref)
            if rdue == due and rnom ~= '-' then nom = rnom end
          end
          if next_due == '-' or (env.kind == 1 and not current) then
            -- The last occurrence, or a schedule replaced or cancelled in flight (its
            -- stream entry goes with the others at the end: one XDEL for the release).
            deletes[#deletes + 1] = id
            if current then
              redis.call('HDEL', IDS, key)
              redis.call('ZREM', REFILL_SET, key)
            end
          else
            reinserts[#reinserts + 1] = {id, next_due}
            -- The next occurrence's nominal time, as CLAIM read the ref (RELEASE is its first change).
            local nnom = ref and select(7, parse_ref(ref)) or '-'
            refill = refill + advance(env, id, key, next_due, nnom)
          end
          hist('fired', key, env.sid, env.topic, env.kind, due, now - tonumber(due), env.size, attempt, '', env.schedule,
            nom)
          if next_due == '-' and env.kind == 1 and current then completed(key, env, due, attempt) end
          fired = fired + 1
        end
      end
      released = released + 1
    end
  end
end
local ok, err = pcall(release_all)
insert_many(reinserts)
delete_envelopes(deletes)
hist_trim()
if not ok then error(err, 0) end
local out = {released, parked, refill, fired, next_wakeup() or ''}
for _, v in ipairs(REFILLS) do out[#out + 1] = v end
return out
