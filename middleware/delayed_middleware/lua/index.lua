-- LIBRARY index.lua: the due index (included by the engine's scripts).
-- Expects the including script's locals for the engine's layout: INDEX_TOP (index
-- top), BUCKET_SEQ (bucket id sequence), PENDING (pending count) and
-- BUCKET_PREFIX (the bucket key prefix, ARGV[1]).
--
-- Two levels, so a pending message costs ~10 bytes of index instead of a
-- skiplist element's ~120: INDEX_TOP is a sorted set of bucket ids scored by
-- their lower bound; bucket `BUCKET_PREFIX..id` is a small sorted set (member =
-- envelope stream id, score = due ms) that Redis keeps listpack-encoded.
-- Buckets partition time: bucket i holds the dues in [start_i, start_i+1).
--
-- Bounded work, whatever the data: a due earlier than every bucket opens a new
-- bucket (nothing moves); a split moves the smaller side only, CHUNK members
-- per command, so no command unpacks a list whose length a user controls. A
-- bucket whose members all share one due time cannot split and just grows.
local BUCKET_MAX = 100
local CHUNK = 500

local function bucket_key(b) return BUCKET_PREFIX .. b end

-- The bucket that holds (or would hold) `due`, or nil when `due` is earlier than all.
local function locate(due)
  return redis.call('ZREVRANGEBYSCORE', INDEX_TOP, due, '-inf', 'LIMIT', 0, 1)[1]
end

local function new_bucket(start)
  local b = tostring(redis.call('INCR', BUCKET_SEQ))
  redis.call('ZADD', INDEX_TOP, start, b)
  return b
end

-- Moves the members of src scored within [from, to] (Redis range syntax) to dst.
local function move(src, dst, from, to)
  while true do
    local got = redis.call('ZRANGEBYSCORE', src, from, to, 'WITHSCORES', 'LIMIT', 0, CHUNK)
    if #got == 0 then return end
    local args, ids = {}, {}
    for i = 1, #got, 2 do
      args[#args + 1] = got[i + 1]
      args[#args + 1] = got[i]
      ids[#ids + 1] = got[i]
    end
    redis.call('ZADD', dst, unpack(args))
    redis.call('ZREM', src, unpack(ids))
  end
end

local function split(b)
  local key = bucket_key(b)
  local n = redis.call('ZCARD', key)
  local mid = math.floor(n / 2)
  local cut = tonumber(redis.call('ZRANGE', key, mid, mid, 'WITHSCORES')[2])
  local low = tonumber(redis.call('ZRANGE', key, 0, 0, 'WITHSCORES')[2])
  if cut == low then
    local nxt = redis.call('ZRANGEBYSCORE', key, '(' .. low, '+inf', 'WITHSCORES', 'LIMIT', 0, 1)
    if not nxt[1] then return end
    cut = tonumber(nxt[2])
  end
  local below = redis.call('ZCOUNT', key, '-inf', '(' .. cut)
  local nb = tostring(redis.call('INCR', BUCKET_SEQ))
  if below <= n - below then
    -- The part below the cut is the smaller: it moves to a new bucket that
    -- takes over this bucket's start, and this one now starts at the cut.
    local start = redis.call('ZSCORE', INDEX_TOP, b)
    move(key, bucket_key(nb), '-inf', '(' .. cut)
    redis.call('ZADD', INDEX_TOP, start, nb)
    redis.call('ZADD', INDEX_TOP, cut, b)
  else
    move(key, bucket_key(nb), cut, '+inf')
    redis.call('ZADD', INDEX_TOP, cut, nb)
  end
end

local function insert(id, due)
  local b = locate(due) or new_bucket(due)
  local key = bucket_key(b)
  redis.call('ZADD', key, due, id)
  redis.call('INCR', PENDING)
  if redis.call('ZCARD', key) > BUCKET_MAX then split(b) end
end

-- Inserts many {id, due} at once (FIRE's recurring re-inserts: a wave of
-- schedules re-enters the index together). Sorted by due, the items that fall
-- into one bucket go in with one ZADD, at most as many as the bucket has room
-- for before it splits (so it never holds more than BUCKET_MAX + 1 and stays
-- listpack-encoded), instead of a bucket lookup, ZADD, INCR and ZCARD each.
local function insert_many(items)
  local n = #items
  if n == 0 then return end
  for _, it in ipairs(items) do it[3] = tonumber(it[2]) end
  table.sort(items, function(a, b) return a[3] < b[3] end)
  local i = 1
  while i <= n do
    local b = locate(items[i][2]) or new_bucket(items[i][2])
    local key = bucket_key(b)
    -- Buckets partition time: this one ends where the next one starts.
    local upper = redis.call('ZRANGEBYSCORE', INDEX_TOP, '(' .. redis.call('ZSCORE', INDEX_TOP, b), '+inf',
      'WITHSCORES', 'LIMIT', 0, 1)[2]
    upper = upper and tonumber(upper)
    local room = math.max(1, BUCKET_MAX + 1 - redis.call('ZCARD', key))
    local args = {}
    while i <= n and #args < 2 * room and (upper == nil or items[i][3] < upper) do
      args[#args + 1] = items[i][2]
      args[#args + 1] = items[i][1]
      i = i + 1
    end
    redis.call('ZADD', key, unpack(args))
    redis.call('INCRBY', PENDING, #args / 2)
    if redis.call('ZCARD', key) > BUCKET_MAX then split(b) end
  end
end

-- Removes `id` (due at `due`); returns 1 if it was in the index.
local function remove(id, due)
  local b = locate(due)
  if not b then return 0 end
  local key = bucket_key(b)
  local removed = redis.call('ZREM', key, id)
  if removed == 1 then
    redis.call('DECR', PENDING)
    if redis.call('EXISTS', key) == 0 then redis.call('ZREM', INDEX_TOP, b) end
  end
  return removed
end

-- The earliest due time pending, or nil.
local function head()
  while true do
    local b = redis.call('ZRANGE', INDEX_TOP, 0, 0)[1]
    if not b then return nil end
    local h = redis.call('ZRANGE', bucket_key(b), 0, 0, 'WITHSCORES')[2]
    if h then return h end
    redis.call('ZREM', INDEX_TOP, b)
  end
end

-- The first chunk due_iter reads; each next one is twice as large, up to DUE_CHUNK_MAX.
local DUE_CHUNK, DUE_CHUNK_MAX = 32, 128

-- An iterator over up to `limit` {stream id, due, bucket} due at `now`,
-- earliest first; removes nothing. It reads the index a chunk at a time
-- (DUE_CHUNK, doubling up to DUE_CHUNK_MAX), so a batch that stops early (its time or work
-- budget) has not read, nor built a table for, the candidates it never
-- reaches: FIRE stopped at its time budget after ~325 of the 500 it read.
-- `on_chunk` (optional) is handed each chunk before its first candidate is
-- returned (FIRE reads the chunk's envelopes ahead: common.lua's read_ahead).
local function due_iter(now, limit, on_chunk)
  local buf, at, seen = {}, 1, 0
  local top_offset, bs, bi = 0, {}, 1
  -- The bucket being read (nil: take the next), and how many of its due members were read.
  local bucket, read = nil, 0
  local chunk = DUE_CHUNK
  local function fill()
    buf, at = {}, 1
    while #buf == 0 and seen < limit do
      if bucket == nil then
        if bi > #bs then
          bs, bi = redis.call('ZRANGEBYSCORE', INDEX_TOP, '-inf', now, 'LIMIT', top_offset, 8), 1
          top_offset = top_offset + #bs
          if #bs == 0 then return end
        end
        bucket, read = bs[bi], 0
        bi = bi + 1
      end
      local want = math.min(chunk, limit - seen)
      chunk = math.min(chunk * 2, DUE_CHUNK_MAX)
      local got = redis.call('ZRANGEBYSCORE', bucket_key(bucket), '-inf', now, 'WITHSCORES', 'LIMIT', read, want)
      for i = 1, #got, 2 do buf[#buf + 1] = {got[i], got[i + 1], bucket} end
      read = read + #got / 2
      seen = seen + #got / 2
      -- Fewer than asked: this bucket has no more members due.
      if #got / 2 < want then bucket = nil end
    end
    if on_chunk and #buf > 0 then on_chunk(buf) end
  end
  return function()
    if at > #buf then fill() end
    local c = buf[at]
    at = at + 1
    return c
  end
end

-- Up to `limit` {stream id, due, bucket} due at `now`, earliest first; removes nothing.
local function due_candidates(now, limit)
  local out = {}
  for c in due_iter(now, limit) do out[#out + 1] = c end
  return out
end

-- Removes candidates (as due_candidates gave them, buckets unchanged since)
-- from the index in one ZREM per bucket, CHUNK ids per command.
local function remove_candidates(cs)
  local by_bucket, order = {}, {}
  for _, c in ipairs(cs) do
    local list = by_bucket[c[3]]
    if not list then
      list = {}
      by_bucket[c[3]] = list
      order[#order + 1] = c[3]
    end
    list[#list + 1] = c[1]
  end
  local removed = 0
  for _, b in ipairs(order) do
    local key, ids = bucket_key(b), by_bucket[b]
    for i = 1, #ids, CHUNK do
      removed = removed + redis.call('ZREM', key, unpack(ids, i, math.min(i + CHUNK - 1, #ids)))
    end
    if redis.call('EXISTS', key) == 0 then redis.call('ZREM', INDEX_TOP, b) end
  end
  if removed > 0 then redis.call('DECRBY', PENDING, removed) end
end

-- ids hash values: "<stream id> <due ms> <next ms | - | purge> <next RFC3339 | -> <i | u>"
-- (i: in the index, u: waiting for REFILL), then, only where an occurrence's nominal
-- time differs from its due time (jitter, a paced catch-up): "<due's nominal ms | ->
-- <next's nominal ms | ->" ('-': the same as the due time). A release that reads five
-- parts ignores the two: it fires the occurrence all the same. Version 1 wrote
-- "<stream id> <due ms>".
local function parse_ref(v)
  local parts = {}
  for p in string.gmatch(v, '%S+') do parts[#parts + 1] = p end
  return parts[1], parts[2], parts[3] or '-', parts[4] or '-', parts[5] or 'i', parts[6] or '-', parts[7] or '-'
end

local function make_ref(id, due, nxt, iso, flag, nom, nnom)
  local ref = id .. ' ' .. due .. ' ' .. nxt .. ' ' .. iso .. ' ' .. flag
  if (nom and nom ~= '-') or (nnom and nnom ~= '-') then
    ref = ref .. ' ' .. (nom or '-') .. ' ' .. (nnom or '-')
  end
  return ref
end
