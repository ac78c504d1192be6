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
local t = redis.call('TYPE', TARGET).ok
local bad = nil
if t ~= 'stream' and t ~= 'none' then bad = 'WRONGTYPE: the key is a ' .. t .. ', not a stream' end
local out, pos = {}, 3
for i = 1, tonumber(N_OCCURRENCES) do
  local nominal = ARGV[pos]
  local k = tonumber(ARGV[pos + 1])
  pos = pos + 2
  local entries = {}
  for _ = 1, k do
    local m = tonumber(ARGV[pos])
    entries[#entries + 1] = {pos + 1, m}
    pos = pos + 1 + 2 * m
  end
  if bad then
    out[i] = bad
  elseif redis.call('ZADD', RECORD, 'NX', nominal, nominal) == 0 then
    out[i] = 'dup'
  else
    local done, failed = 0, nil
    for _, e in ipairs(entries) do
      local args = {TARGET, '*'}
      for j = e[1], e[1] + 2 * e[2] - 1 do args[#args + 1] = ARGV[j] end
      local ok, err = pcall(redis.call, 'XADD', unpack(args))
      if not ok then
        failed = tostring(err)
        break
      end
      done = done + 1
    end
    if failed and done == 0 then
      -- Nothing of it went out: not recorded, so a later backfill delivers it.
      redis.call('ZREM', RECORD, nominal)
      out[i] = failed
    else
      out[i] = 'ok'
    end
  end
end
if redis.call('EXISTS', RECORD) == 1 then redis.call('PEXPIRE', RECORD, RETENTION_MS) end
return out
