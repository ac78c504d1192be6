"""The Lua scripts of the delay engine: every state change of a delayed message.

Each script runs atomically inside Redis, which is what makes firing exactly
once: a message leaves the due index (ZREM returning 1) in the same atomic step
that appends it to its target topic, so a second replica, a retry after a
crash, or a replay of the same batch finds it gone and writes nothing.

Key layout: see delayed_middleware.keys.EngineKeys.
"""

from __future__ import annotations

from delayed_middleware.entry import CONTENT_TYPE, DATA, METADATA

# The due index, shared by the scripts below: a two-level structure so that a
# pending message costs ~25 bytes of index instead of a skiplist element's ~120.
# KEYS[2] (top) is a sorted set of buckets scored by their lower bound; each
# bucket `ARGV[1]..id` is a small sorted set (member = envelope stream id,
# score = due ms) that Redis keeps listpack-encoded. Buckets partition time:
# bucket i holds the dues in [start_i, start_i+1). A bucket over BUCKET_MAX
# entries splits in two at a due-time boundary; one whose entries all share a
# due time cannot split and simply grows (a burst costs what a plain zset does).
# KEYS[4] is the bucket id sequence, KEYS[5] the pending count.
BUCKET_MAX = 100
_INDEX = f"""
local function bucket_key(b) return ARGV[1] .. b end

-- The bucket that holds (or would hold) `due`; with `create`, makes room for it.
local function locate(due, create)
  local b = redis.call('ZREVRANGEBYSCORE', KEYS[2], due, '-inf', 'LIMIT', 0, 1)[1]
  if b then return b end
  b = redis.call('ZRANGE', KEYS[2], 0, 0)[1]
  if not create then return b end
  if b then
    -- Earlier than every bucket: the first one now starts at `due`.
    redis.call('ZADD', KEYS[2], due, b)
    return b
  end
  b = tostring(redis.call('INCR', KEYS[4]))
  redis.call('ZADD', KEYS[2], due, b)
  return b
end

local function split(b)
  local key = bucket_key(b)
  local n = redis.call('ZCARD', key)
  local cut = tonumber(redis.call('ZRANGE', key, math.floor(n / 2), math.floor(n / 2), 'WITHSCORES')[2])
  local low = tonumber(redis.call('ZRANGE', key, 0, 0, 'WITHSCORES')[2])
  if cut == low then
    local nxt = redis.call('ZRANGEBYSCORE', key, '(' .. low, '+inf', 'WITHSCORES', 'LIMIT', 0, 1)
    if not nxt[1] then return end
    cut = tonumber(nxt[2])
  end
  local moved = redis.call('ZRANGEBYSCORE', key, cut, '+inf', 'WITHSCORES')
  local nb = tostring(redis.call('INCR', KEYS[4]))
  local args = {{}}
  for i = 1, #moved, 2 do
    args[#args + 1] = moved[i + 1]
    args[#args + 1] = moved[i]
  end
  redis.call('ZADD', bucket_key(nb), unpack(args))
  redis.call('ZREMRANGEBYSCORE', key, cut, '+inf')
  redis.call('ZADD', KEYS[2], cut, nb)
end

local function insert(id, due)
  local b = locate(due, true)
  local key = bucket_key(b)
  redis.call('ZADD', key, due, id)
  redis.call('INCR', KEYS[5])
  if redis.call('ZCARD', key) > {BUCKET_MAX} then split(b) end
end

-- Removes `id` (due at `due`); returns 1 if it was pending.
local function remove(id, due)
  local b = locate(due, false)
  if not b then return 0 end
  local key = bucket_key(b)
  local removed = redis.call('ZREM', key, id)
  if removed == 1 then
    redis.call('DECR', KEYS[5])
    if redis.call('EXISTS', key) == 0 then redis.call('ZREM', KEYS[2], b) end
  end
  return removed
end

-- The earliest due time pending, or nil.
local function head()
  local b = redis.call('ZRANGE', KEYS[2], 0, 0)[1]
  if not b then return nil end
  return redis.call('ZRANGE', bucket_key(b), 0, 0, 'WITHSCORES')[2]
end

-- Takes up to `limit` ids due at `now` out of the index, earliest first.
-- Returns the ids and the due time of the first.
local function take_due(now, limit)
  local ids, first = {{}}, nil
  while #ids < limit do
    local b = redis.call('ZRANGE', KEYS[2], 0, 0)[1]
    if not b then break end
    local key = bucket_key(b)
    local got = redis.call('ZRANGEBYSCORE', key, '-inf', now, 'WITHSCORES', 'LIMIT', 0, limit - #ids)
    if #got == 0 then break end
    if first == nil then first = got[2] end
    for i = 1, #got, 2 do ids[#ids + 1] = got[i] end
    redis.call('ZREMRANGEBYRANK', key, 0, #got / 2 - 1)
    if redis.call('EXISTS', key) == 1 then break end
    -- Emptied: the next bucket may hold due ones too.
    redis.call('ZREM', KEYS[2], b)
  end
  if #ids > 0 then redis.call('DECRBY', KEYS[5], #ids) end
  return ids, first
end

-- ids hash values are "<stream id> <due ms>": enough to find the bucket.
local function parse_ref(v)
  local sp = string.find(v, ' ', 1, true)
  return string.sub(v, 1, sp - 1), string.sub(v, sp + 1)
end
"""

# SCHEDULE: store envelopes durably and index them by due time.
# KEYS: 1 stream (the delayed topic), 2 index top, 3 ids hash, 4 bucket seq, 5 pending count
# ARGV[1] bucket key prefix, ARGV[2] wake channel,
# ARGV[3] n, then n triples: envelope bytes, due ms, scheduleId ('' for none)
# Returns the new envelope stream ids, in order.
# A scheduleId already pending is replaced: its old envelope leaves the index
# and the stream, so it can never fire. The wake channel is told when a new
# envelope became the earliest, so sleeping replicas shorten their sleep.
SCHEDULE = (
    _INDEX
    + f"""
local n = tonumber(ARGV[3])
local ids = {{}}
local earliest = nil
for i = 0, n - 1 do
  local env = ARGV[4 + i * 3]
  local due = ARGV[5 + i * 3]
  local sid = ARGV[6 + i * 3]
  local id = redis.call('XADD', KEYS[1], '*', '{DATA}', env, '{METADATA}', '{{}}')
  insert(id, due)
  if sid ~= '' then
    local old = redis.call('HGET', KEYS[3], sid)
    if old then
      local old_id, old_due = parse_ref(old)
      remove(old_id, old_due)
      redis.call('XDEL', KEYS[1], old_id)
    end
    redis.call('HSET', KEYS[3], sid, id .. ' ' .. due)
  end
  ids[#ids + 1] = id
  if earliest == nil or tonumber(due) < earliest then earliest = tonumber(due) end
end
local h = head()
if earliest ~= nil and h ~= nil and tonumber(h) >= earliest then
  redis.call('PUBLISH', ARGV[2], tostring(earliest))
end
return ids
"""
)

# The DelayedMessage decoder, in Lua, so firing needs no round trip through
# the client: a batch is read, decoded and appended inside one script. It knows
# only what firing needs (fields 1-5 and 10; DelayedBulk) and raises on
# malformed input, which the caller catches with pcall.
_DECODE = """
local byte, sub = string.byte, string.sub

-- Reads a varint at pos; returns value, next pos. A truncated one errors
-- (comparing nil), which the caller's pcall turns into "undecodable".
local function varint(s, pos)
  local b = byte(s, pos)
  if b < 128 then return b, pos + 1 end
  local result, mul = b - 128, 128
  pos = pos + 1
  while true do
    b = byte(s, pos)
    pos = pos + 1
    if b < 128 then return result + b * mul, pos end
    result = result + (b - 128) * mul
    mul = mul * 128
  end
end

-- Skips a field of wire type wt at pos (0, 1, 5); length-delimited ones are
-- handled by the callers, who need their bounds.
local function skip(s, wt, pos)
  if wt == 0 then local _, p = varint(s, pos); return p end
  if wt == 1 then return pos + 8 end
  if wt == 5 then return pos + 4 end
  error('unsupported wire type')
end

-- A map<string,string> entry in s[from..to]: returns key, value.
local function map_entry(s, from, to)
  local k, v, pos = '', '', from
  while pos <= to do
    local key
    key, pos = varint(s, pos)
    local f, wt = (key - key % 8) / 8, key % 8
    if wt == 2 then
      local len
      len, pos = varint(s, pos)
      local e = pos + len - 1
      if e > to then error('truncated map entry') end
      if f == 1 then k = sub(s, pos, e) elseif f == 2 then v = sub(s, pos, e) end
      pos = e + 1
    else
      pos = skip(s, wt, pos)
    end
  end
  return k, v
end

-- One message in s[from..to] with data/contentType/metadata at the given
-- field numbers (DelayedMessage: 2/3/4; DelayedBulkEntry: 2/3/4 as well).
-- Returns data, content type, metadata table, and the fields 1, 5 and 10.
local function message(s, from, to)
  local f1, data, ct, md, f5, f10, pos = '', '', '', {}, 0, '', from
  while pos <= to do
    local key
    key, pos = varint(s, pos)
    local f, wt = (key - key % 8) / 8, key % 8
    if wt == 2 then
      local len
      len, pos = varint(s, pos)
      local e = pos + len - 1
      if e > to then error('truncated field') end
      if f == 1 then f1 = sub(s, pos, e)
      elseif f == 2 then data = sub(s, pos, e)
      elseif f == 3 then ct = sub(s, pos, e)
      elseif f == 4 then local k, v = map_entry(s, pos, e); md[k] = v
      elseif f == 10 then f10 = sub(s, pos, e)
      end
      pos = e + 1
    elseif wt == 0 then
      local v
      v, pos = varint(s, pos)
      if f == 5 then f5 = v end
    else
      pos = skip(s, wt, pos)
    end
  end
  return f1, data, ct, md, f5, f10
end

-- Returns {topic, entries = {{data, metadata table, content type}, ...}, scheduleId}.
local function decode(s)
  local topic, body, ct, md, bulk, sid = message(s, 1, #s)
  if topic == '' then error('no topic') end
  if bulk == 0 then return {topic, {{body, md, ct}}, sid} end
  local entries, pos, n = {}, 1, #body
  while pos <= n do
    local key
    key, pos = varint(body, pos)
    local f, wt = (key - key % 8) / 8, key % 8
    if wt == 2 then
      local len
      len, pos = varint(body, pos)
      local e = pos + len - 1
      if e > n then error('truncated bulk entry') end
      if f == 1 then
        local _, event, ect, emd = message(body, pos, e)
        entries[#entries + 1] = {event, emd, ect}
      end
      pos = e + 1
    else
      pos = skip(body, wt, pos)
    end
  end
  return {topic, entries, sid}
end
"""

# Keys added to the metadata of every fired message (the public contract).
SCHEDULER = "scheduler"
SCHEDULE_NEXT = "scheduleNext"

# FIRE_DUE: move what is due to its target topics, exactly once.
# KEYS: 1 stream (the delayed topic), 2 index top, 3 ids hash, 4 bucket seq, 5 pending count
# ARGV[1] bucket key prefix, ARGV[2] now ms, ARGV[3] batch limit,
# ARGV[4] trim mode ('' | 'MAXLEN' | 'MINID'), ARGV[5] trim threshold
# Each fired message gets metadata `scheduler` (its scheduleId, else its
# envelope's id on the delayed topic) and `scheduleNext` = 'purge' (one-shot).
# Returns {fired, head, first, pending, bad id, bad id, ...}: head is the
# earliest due time left ('' when none), first the earliest due time of this
# batch ('' when nothing was due), pending how many are left in the index. An envelope is fired, and leaves the index and the
# delayed topic, in the same atomic step, so no replica, retry or crash can
# fire it twice. One that cannot be decoded leaves the index (so it cannot
# spin the loop) but stays on the delayed topic for an operator to inspect.
# Target topics are computed from the envelopes, so they are not in KEYS:
# fine on a single node; Redis Cluster needs the two-phase variant.
FIRE_DUE = (
    _INDEX
    + _DECODE
    + f"""
local ids, first = take_due(ARGV[2], tonumber(ARGV[3]))
local pending = tonumber(redis.call('GET', KEYS[5]) or '0')
if #ids == 0 then
  return {{0, head() or '', '', pending}}
end
local fired, bad, done = 0, {{}}, {{}}
for _, id in ipairs(ids) do
  local e = redis.call('XRANGE', KEYS[1], id, id)
  local data = nil
  if e[1] then
    local f = e[1][2]
    for j = 1, #f, 2 do
      if f[j] == '{DATA}' then data = f[j + 1] end
    end
  end
  local ok, env = false, nil
  if data then ok, env = pcall(decode, data) end
  if ok then
    for _, entry in ipairs(env[2]) do
      -- What produced it, and that nothing follows (a one-shot): the contract's
      -- delivered-message keys, beside the user's own.
      entry[2]['{SCHEDULER}'] = env[3] ~= '' and env[3] or id
      entry[2]['{SCHEDULE_NEXT}'] = 'purge'
      local args = {{env[1]}}
      if ARGV[4] ~= '' then
        args[#args + 1] = ARGV[4]
        args[#args + 1] = '~'
        args[#args + 1] = ARGV[5]
      end
      args[#args + 1] = '*'
      args[#args + 1] = '{DATA}'
      args[#args + 1] = entry[1]
      args[#args + 1] = '{METADATA}'
      args[#args + 1] = cjson.encode(entry[2])
      if entry[3] ~= '' then
        args[#args + 1] = '{CONTENT_TYPE}'
        args[#args + 1] = entry[3]
      end
      redis.call('XADD', unpack(args))
    end
    done[#done + 1] = id
    if env[3] ~= '' then
      local ref = redis.call('HGET', KEYS[3], env[3])
      if ref and parse_ref(ref) == id then redis.call('HDEL', KEYS[3], env[3]) end
    end
    fired = fired + 1
  else
    bad[#bad + 1] = id
  end
end
for i = 1, #done, 1000 do
  redis.call('XDEL', KEYS[1], unpack(done, i, math.min(i + 999, #done)))
end
local out = {{fired, head() or '', first, pending}}
for _, id in ipairs(bad) do out[#out + 1] = id end
return out
"""
)

# CANCEL: withdraw a pending envelope by scheduleId; nothing is delivered.
# KEYS: 1 stream, 2 index top, 3 ids hash, 4 bucket seq, 5 pending count
# ARGV[1] bucket key prefix, ARGV[2] scheduleId
# Returns 1 when something pending was canceled, 0 when nothing was pending.
CANCEL = (
    _INDEX
    + """
local ref = redis.call('HGET', KEYS[3], ARGV[2])
if not ref then return 0 end
redis.call('HDEL', KEYS[3], ARGV[2])
local id, due = parse_ref(ref)
local removed = remove(id, due)
redis.call('XDEL', KEYS[1], id)
return removed
"""
)
