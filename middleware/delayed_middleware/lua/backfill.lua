-- BACKFILL: delivers past occurrences of one recurring schedule (delayed_middleware/backfill.py),
-- each at most once however many backfills of it run, one or many at once. In the TARGET's
-- slot: one call per chunk of occurrences bound for one target key.
-- KEYS: 1 the target stream (the schedule's topic, or its shard's outbox for targetPubsub),
--       2 the schedule's backfill record ({<target's tag>}:<shard stream>}backfilled:<schedule key>,
--         see keys.backfill_record): sorted set, member = an occurrence's nominal ms, score the same
-- ARGV: 1 the record's retention ms (renewed by every call), 2 n occurrences; then per occurrence:
--       its nominal ms, k entries, then per entry: m field/value pairs, then the 2m strings
--       (data, metadata, contentType, expiresAt, ... as the caller encoded them)
-- Returns one status per occurrence: 'ok' (appended now), 'dup' (in the record already:
-- delivered by an earlier or concurrent backfill), or the error that kept its first entry
-- out (then it is not recorded, and a later backfill tries it again).
--
-- Why at most once: an occurrence enters the record (ZADD NX) in the same atomic step as its
-- XADDs, so two backfills of overlapping ranges, run one after the other or at the same time,
-- append each occurrence once. Bounded: the caller sends a chunk of at most a few dozen
-- occurrences and a few hundred KB (backfill.CHUNK_*), so one call holds Redis ~ms.
local TARGET, RECORD = KEYS[1], KEYS[2]
local RETENTION_MS, N_OCCURRENCES = ARGV[1], ARGV[2]
-- ARGV is read front to back, one value per call.
local at = 2
local function arg()
  at = at + 1
  return ARGV[at]
end
-- The target's verdict, once: nothing here changes its type (an XADD only creates a stream).
local kind = redis.call('TYPE', TARGET).ok
local refused = (kind ~= 'stream' and kind ~= 'none') and ('WRONGTYPE: the key is a ' .. kind .. ', not a stream') or nil
local statuses = {}
for i = 1, tonumber(N_OCCURRENCES) do
  local nominal, xadds = arg(), {}
  for e = 1, tonumber(arg()) do
    local xadd = {TARGET, '*'}
    for _ = 1, 2 * tonumber(arg()) do xadd[#xadd + 1] = arg() end
    xadds[e] = xadd
  end
  if refused then
    statuses[i] = refused
  elseif redis.call('ZADD', RECORD, 'NX', nominal, nominal) == 0 then
    statuses[i] = 'dup'
  else
    statuses[i] = 'ok'
    for e, xadd in ipairs(xadds) do
      local ok, err = pcall(redis.call, 'XADD', unpack(xadd))
      if not ok then
        -- Nothing of it went out: not recorded, so a later backfill delivers it. After
        -- its first entry, what went out stays recorded (as a fire's partial append).
        if e == 1 then
          redis.call('ZREM', RECORD, nominal)
          statuses[i] = tostring(err)
        end
        break
      end
    end
  end
end
if redis.call('EXISTS', RECORD) == 1 then redis.call('PEXPIRE', RECORD, RETENTION_MS) end
return statuses
