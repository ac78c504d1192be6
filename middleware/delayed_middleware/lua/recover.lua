-- RECOVER: put back in the due index the pending envelopes no index entry refers to
-- (orphans), walking one stretch of the delayed topic.
-- KEYS: the two-phase layout (1 delayed stream, 2 index top, 3 ids hash, 4 bucket seq,
--       5 pending count, 6 history, 7 parked, 8 call tokens, 9 refill, 10 outbox,
--       11 in-flight zset, 12 claims hash), the moved hash last (moved.lua). On a
--       single node the in-flight and claims keys simply do not exist.
-- ARGV: 1 bucket key prefix, 2 cursor: the last stream id walked ('-' from the start),
--       3 the sweep's end (the stream's last id when it began), 4 max entries,
--       5 Redis time budget us (0 = none), 6 now ms (history; '' = Redis TIME),
--       7 history maxlen (0 = off), 8 wake channel
-- Returns {cursor, recovered, dropped, earliest}: the last stream id walked ('' once the
-- sweep reached its end), envelopes put back in the index, copies of cancelled or
-- replaced messages deleted, and the earliest due time recovered ('' when none).
--
-- How an orphan comes about: release 0.1.0 does not know the moved hash. Run on data
-- where compaction re-homed envelopes (format 2), it finds no envelope at a due entry's
-- id, reports it lost and drops the index entry, and the re-homed copy stays on the
-- delayed topic for good: listed by `pending`, never fired. Its cancels and replaces
-- likewise drop the ref and the index entry and leave the copy.
--
-- An entry is a live pending envelope that no index entry refers to when, checked in
-- this atomic step (so no FIRE, CLAIM, cancel or replace interleaves):
--   - it decodes as an envelope, and its public id P is known: its own stream id, or
--     for a compaction copy its `origin` when the moved hash points at this copy, or
--     when the moved hash has no record of that origin and no entry is stored at the
--     origin's own id (the record went with the index entry). A copy whose origin the
--     moved hash maps to another entry is not that envelope: left alone;
--   - it is not parked (PARKED) nor claimed in flight (Cluster's CLAIMS);
--   - with a scheduleId (or recurring, keyed by P): its ids-hash ref names P with the
--     flag 'i' (in the index; 'p' paused and 'u' waiting for REFILL are held on
--     purpose); the ref's due is where it belongs. A ref that is gone or names
--     another envelope means the message was cancelled or replaced: that copy is
--     deleted (what the cancel or replace would have done), never fired. But a ref
--     naming an id stored nowhere and older than this copy names this copy: its id was
--     lost to a compaction that re-homed it after its move record went (a replacement
--     is younger than the copies made before it);
--   - P is in the index neither at that due nor at the envelope's own.
-- Then P goes back in the index at that due (past due: it fires at the next step),
-- the move record is restored if it was gone, and a `recovered` record is written.
-- Once indexed, a second walk (or another replica's) finds it indexed: exactly once.
-- Bounded: max entries per call and a Redis time budget, as COMPACT.
local STREAM, INDEX_TOP, IDS, BUCKET_SEQ, PENDING, HISTORY, PARKED, CALLS, REFILL_SET, OUTBOX =
  KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6], KEYS[7], KEYS[8], KEYS[9], KEYS[10]
local CLAIMS = KEYS[12]
local MOVED = KEYS[#KEYS]
local BUCKET_PREFIX, CURSOR, LAST, MAX_ENTRIES, BUDGET_US, NOW_ARG, HIST_LEN, WAKE_CHANNEL =
  ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6], ARGV[7], ARGV[8]
--!include index.lua
--!include decode.lua
--!include history.lua
--!include common.lua
--!include budget.lua
local now = decision_now(NOW_ARG)
HIST_MAXLEN, HIST_NOW = tonumber(HIST_LEN), string.format('%.0f', now)
local spent = walk_budget(tonumber(BUDGET_US or '0'))

-- True when `id` is in the index at `due` (buckets partition time: only one can hold it).
local function indexed(id, due)
  local b = locate(due)
  return b ~= nil and redis.call('ZSCORE', bucket_key(b), id) ~= false
end

-- The public id of the entry stored at `at` with `origin` (nil: none), whether its move
-- record has to be restored, or nil when the entry is not to be touched.
local function public_id(at, origin)
  if not origin or origin == at then return at, false end
  local mapped = redis.call('HGET', MOVED, origin)
  if mapped == at then return origin, false end
  if mapped then return nil end
  if redis.call('XRANGE', STREAM, origin, origin)[1] then return nil end
  return origin, true
end

-- True when stream id `a` is older than stream id `b` (false for anything else).
local function older(a, b)
  local am, as = string.match(a, '^(%d+)%-(%d+)$')
  local bm, bs = string.match(b, '^(%d+)%-(%d+)$')
  if not am or not bm then return false end
  am, as, bm, bs = tonumber(am), tonumber(as), tonumber(bm), tonumber(bs)
  return am < bm or (am == bm and as < bs)
end

local before = head()
local cursor = CURSOR
local from = cursor == '-' and '-' or '(' .. cursor
local rows = redis.call('XRANGE', STREAM, from, LAST, 'COUNT', tonumber(MAX_ENTRIES))
local recovered, dropped, earliest, walked = 0, 0, nil, 0
for i, e in ipairs(rows) do
  if spent(i) then break end
  local at, f = e[1], e[2]
  cursor, walked = at, walked + 1
  local data, origin = nil, nil
  for j = 1, #f, 2 do
    if f[j] == 'data' then data = f[j + 1] elseif f[j] == 'origin' then origin = f[j + 1] end
  end
  local id, restore = public_id(at, origin)
  local ok, env = false, nil
  if id and data then ok, env = pcall(decode, data) end
  -- Not an envelope this release reads: FIRE parks those when they fall due.
  if ok then
    local key = nil
    if env.sid ~= '' then key = env.sid elseif env.kind == 1 then key = id end
    local own = string.format('%.0f', env.due)
    local ref = key and redis.call('HGET', IDS, key)
    local named = ref and parse_ref(ref)
    local was = nil
    if named and named ~= id and stored_at(named) == at then
      id = named
    elseif named and named ~= id and env.sid ~= '' and older(named, at) then
      local st = stored_at(named)
      if not redis.call('XRANGE', STREAM, st, st)[1] then
        -- The envelope its scheduleId names is stored nowhere: this copy is that envelope, its
        -- id lost to a compaction that re-homed it after its move record was gone.
        was, id, restore = id, named, true
      end
    end
    -- Held on purpose (checked again under the id the ref gave), or indexed at its own due:
    -- FIRE decides it (fires it, or drops a replaced recurring one).
    local held = redis.call('HEXISTS', PARKED, id) == 1 or redis.call('HEXISTS', CLAIMS, id) == 1
    local due = not held and not indexed(id, own) and own or nil
    if due and key then
      if not ref or named ~= id then
        -- Cancelled or replaced by a release that did not find this copy.
        redis.call('XDEL', STREAM, at)
        if redis.call('HGET', MOVED, id) == at then forget_move(id) end
        dropped = dropped + 1
        due = nil
      else
        local _, rdue, _, _, flag = parse_ref(ref)
        if flag ~= 'i' or not tonumber(rdue) or indexed(id, rdue) then due = nil else due = rdue end
      end
    end
    if due then
      if was then
        -- Re-homed with its true id in `origin` (as compact.lua writes it), so the moved hash and
        -- the entry agree and a later compaction keeps the id.
        if redis.call('HGET', MOVED, was) == at then forget_move(was) end
        local args = {STREAM, '*'}
        for j = 1, #f, 2 do
          if f[j] ~= 'origin' and f[j] ~= 'from' then
            args[#args + 1] = f[j]
            args[#args + 1] = f[j + 1]
          end
        end
        for _, v in ipairs({'origin', id, 'from', at}) do args[#args + 1] = v end
        local copy = redis.call('XADD', unpack(args))
        redis.call('XDEL', STREAM, at)
        at = copy
      end
      if restore then redis.call('HSET', MOVED, id, at) end
      insert(id, due)
      hist('recovered', key or id, env.sid, env.topic, env.kind, due, '', env.size, math.max(env.attempt, 1),
        'NotIndexed', env.schedule)
      recovered = recovered + 1
      if earliest == nil or tonumber(due) < earliest then earliest = tonumber(due) end
    end
  end
end
if walked == #rows and #rows < tonumber(MAX_ENTRIES) then cursor = '' end
if earliest ~= nil and (before == nil or tonumber(before) > earliest) then
  redis.call('PUBLISH', WAKE_CHANNEL, string.format('%.0f', earliest))
end
return {cursor, recovered, dropped, earliest and string.format('%.0f', earliest) or ''}
