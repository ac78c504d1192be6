-- REFILL: give recurring envelopes their next due time, computed by a replica in
-- Python (cron arithmetic has no place in Lua). Each item is a compare-and-set
-- on the ids hash ref, so a refill racing a replace, a cancel or another
-- replica's refill changes nothing.
-- KEYS: 1 delayed stream, 2 index top, 3 ids hash, 4 bucket seq, 5 pending count,
--       6 history, 7 parked, 8 call tokens, 9 refill, 10 outbox, 11 moved hash (moved.lua)
-- ARGV: 1 bucket key prefix, 2 wake channel, 3 n, then n groups of 9:
--       envelope id (ids hash key), the ref the replica read, next due ms
--       ('purge': the schedule ends after the pending occurrence; 'end': withdraw it
--       now, e.g. its envelope is gone or its schedule cannot be computed), next due
--       RFC3339 ('-' with purge; with 'end': the reason, for its 'cancelled' record),
--       the pending occurrence's new due ms ('-': it stays; a catch-up moved it), its
--       nominal ms ('-': the ref's own, or its due), the next one's nominal ms ('-':
--       the next due), the first skipped nominal ms ('': nothing skipped) and the
--       'skipped' record's reason (engine/catchup.py);
--       then (optional) history maxlen (0 = off) and now ms, for those records
-- Returns one result per item: 1 applied, 2 ended, 0 stale (the caller re-reads), -1 the id is gone.
-- 'end' is a compare-and-set too: a replace that landed after the replica read
-- the ref is a new ref, so the replacement is never withdrawn by mistake.
local STREAM, INDEX_TOP, IDS, BUCKET_SEQ, PENDING, HISTORY, PARKED, CALLS, REFILL_SET, OUTBOX =
  KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6], KEYS[7], KEYS[8], KEYS[9], KEYS[10]
local MOVED = KEYS[#KEYS]
local BUCKET_PREFIX, WAKE_CHANNEL, N_ITEMS =
  ARGV[1], ARGV[2], ARGV[3]
--!include index.lua
--!include decode.lua
--!include history.lua
--!include common.lua
local n_items = tonumber(N_ITEMS)
local GROUP = 9
HIST_MAXLEN, HIST_NOW = tonumber(ARGV[4 + GROUP * n_items] or '0'), ARGV[5 + GROUP * n_items] or '0'
local before = head()
local earliest = nil
local out = {}
for i = 0, n_items - 1 do
  local at = 4 + i * GROUP
  local key, read, nxt, iso = ARGV[at], ARGV[at + 1], ARGV[at + 2], ARGV[at + 3]
  local cur, cur_nom, nnom, skip_from, skip_why = ARGV[at + 4], ARGV[at + 5], ARGV[at + 6], ARGV[at + 7], ARGV[at + 8]
  local ref = redis.call('HGET', IDS, key)
  if not ref then
    redis.call('ZREM', REFILL_SET, key)
    out[#out + 1] = -1
  elseif ref ~= read then
    out[#out + 1] = 0
  elseif nxt == 'end' then
    local sid, due = parse_ref(ref)
    local env = read_envelope(sid)
    drop_ref(key, ref)
    redis.call('HDEL', IDS, key)
    if env then
      hist('cancelled', key, env.sid, env.topic, env.kind, due, '', env.size, math.max(env.attempt, 1), iso, env.schedule)
    else
      hist('cancelled', key, '', '', 1, due, '', '', 1, iso, '')
    end
    out[#out + 1] = 2
  else
    local sid, due, _, _, flag, nom = parse_ref(ref)
    if skip_from ~= '' then
      -- The catch-up skipped missed occurrences: counted and spanned in the reason.
      local env = read_envelope(sid)
      if env then
        hist('skipped', key, env.sid, env.topic, env.kind, skip_from, '', env.size, 1, skip_why, env.schedule)
      else
        hist('skipped', key, '', '', 1, skip_from, '', '', 1, skip_why, '')
      end
    end
    if cur ~= '-' and tonumber(cur) then
      -- The pending occurrence moves (a catch-up skipped it): out of the index at its old due.
      if flag ~= 'u' and tonumber(due) then remove(sid, due) end
      due, flag = cur, 'u'
    end
    if cur_nom ~= '-' then nom = cur_nom end
    if nom == due then nom = '-' end
    if nnom == nxt then nnom = '-' end
    if flag == 'u' then
      insert(sid, due)
      if earliest == nil or tonumber(due) < earliest then earliest = tonumber(due) end
    end
    redis.call('HSET', IDS, key, make_ref(sid, due, nxt, iso, 'i', nom, nnom))
    redis.call('ZREM', REFILL_SET, key)
    out[#out + 1] = 1
  end
end
if earliest ~= nil and (before == nil or tonumber(before) > earliest) then
  redis.call('PUBLISH', WAKE_CHANNEL, tostring(earliest))
end
return out
