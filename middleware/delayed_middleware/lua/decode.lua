-- LIBRARY decode.lua: a DelayedMessage decoder, so firing needs no round trip
-- through the client. Knows the fields firing needs (see proto/delayedpubsub/v1/
-- delayed.proto) and DelayedBulk; raises on malformed input, which callers
-- catch with pcall. Property-tested against the protobuf library.
local byte, sub = string.byte, string.sub

-- Reads a varint at pos; returns value, next pos. A truncated one errors, and so does
-- one longer than protobuf's 10 bytes: its value would overflow to inf, or NaN (0 * inf),
-- and a NaN due time makes the index's commands raise after a script's first write.
-- Unrolled over one string.byte call for all ten bytes: the fire path decodes two
-- 6-byte varints (due and publish times) per envelope, and a call per byte was a
-- third of its decode time. The sum is built in the same order, with the same
-- powers of two, as a byte-at-a-time loop: the same doubles.
local function varint(s, pos)
  local b1, b2, b3, b4, b5, b6, b7, b8, b9, b10 = byte(s, pos, pos + 9)
  if not b1 then error('truncated varint') end
  if b1 < 128 then return b1, pos + 1 end
  local r = b1 - 128
  if not b2 then error('truncated varint') end
  if b2 < 128 then return r + b2 * 128, pos + 2 end
  r = r + (b2 - 128) * 128
  if not b3 then error('truncated varint') end
  if b3 < 128 then return r + b3 * 16384, pos + 3 end
  r = r + (b3 - 128) * 16384
  if not b4 then error('truncated varint') end
  if b4 < 128 then return r + b4 * 2097152, pos + 4 end
  r = r + (b4 - 128) * 2097152
  if not b5 then error('truncated varint') end
  if b5 < 128 then return r + b5 * 268435456, pos + 5 end
  r = r + (b5 - 128) * 268435456
  if not b6 then error('truncated varint') end
  if b6 < 128 then return r + b6 * 34359738368, pos + 6 end
  r = r + (b6 - 128) * 34359738368
  if not b7 then error('truncated varint') end
  if b7 < 128 then return r + b7 * 4398046511104, pos + 7 end
  r = r + (b7 - 128) * 4398046511104
  if not b8 then error('truncated varint') end
  if b8 < 128 then return r + b8 * 562949953421312, pos + 8 end
  r = r + (b8 - 128) * 562949953421312
  if not b9 then error('truncated varint') end
  if b9 < 128 then return r + b9 * 72057594037927936, pos + 9 end
  r = r + (b9 - 128) * 72057594037927936
  if not b10 then error('truncated varint') end
  if b10 < 128 then return r + b10 * 9223372036854775808, pos + 10 end
  error('varint longer than 10 bytes')
end

local function skip(wt, s, pos)
  if wt == 0 then local _, p = varint(s, pos); return p end
  if wt == 1 then return pos + 8 end
  if wt == 5 then return pos + 4 end
  error('unsupported wire type')
end

-- Walks the fields of the message in s[from..to]: on(field number, first, last)
-- for a length-delimited field, on(field number) for a varint; skips the rest.
-- The one walker of the nested messages (map entries, bulk entries); the top
-- level's hot loop (message() below) is written out.
local function each_field(s, from, to, on)
  local pos = from
  while pos <= to do
    local key
    key, pos = varint(s, pos)
    local fno, wt = (key - key % 8) / 8, key % 8
    if wt == 2 then
      local len
      len, pos = varint(s, pos)
      local e = pos + len - 1
      if e > to then error('truncated field') end
      on(fno, pos, e)
      pos = e + 1
    else
      pos = skip(wt, s, pos)
      if wt == 0 then on(fno) end
    end
  end
end

-- A map<string,string> entry in s[from..to]: returns key, value.
-- The form every encoder writes for short strings (key field 1 then value
-- field 2, one-byte lengths, nothing else) is read with one string.byte call
-- and no closure: the fire path decodes each fired envelope's metadata, and
-- the general walk was most of its decode time. Anything else (fields in
-- another order, repeated or unknown fields, long strings) takes the walk.
local function map_entry(s, from, to)
  local t1, kl = byte(s, from, from + 1)
  if t1 == 10 and kl and kl < 128 then
    local vat = from + 2 + kl
    local t2, vl = byte(s, vat, vat + 1)
    if t2 == 18 and vl and vl < 128 and vat + 1 + vl == to then
      return sub(s, from + 2, vat - 1), sub(s, vat + 2, to)
    end
  end
  local k, v = '', ''
  each_field(s, from, to, function(f, b, e)
    if not b then return end
    if f == 1 then k = sub(s, b, e) elseif f == 2 then v = sub(s, b, e) end
  end)
  return k, v
end

-- DelayedMessage's fields by number, as the keys decode() gives them: the
-- length-delimited ones (text, '' when absent; 2 is the payload, or a bulk's
-- entries, 3 its content type) and the varints (0 when absent). 4 is the map.
local TEXT_FIELDS = {[1] = 'topic', [2] = 'body', [3] = 'ct', [6] = 'id', [9] = 'pubsub', [10] = 'sid',
  [12] = 'schedule', [14] = 'source', [16] = 'target'}
local VARINT_FIELDS = {[5] = 'bulk', [7] = 'due', [8] = 'published', [11] = 'kind', [13] = 'expires', [15] = 'sttl',
  [17] = 'attempt', [18] = 'every', [19] = 'catchup', [20] = 'cwindow'}

-- One message in s[from..to]: its bytes fields by number (strings), its varint
-- fields by number, the map at field 4 and how many map entries it read (what
-- firing the message costs grows with it). Two tables, not one checked per
-- field: the fire path decodes every envelope it fires, so this is its hot
-- loop; a field seen again with the other wire type clears the first (the
-- last one wins, as protobuf's parser does). Single-byte keys and lengths,
-- nearly all of them, skip the varint call. With `spans`, nothing is copied or
-- decoded: fs[n] is where bytes field n starts and the fifth result (a table
-- only then) where it ends, and the map is skipped (cancel.lua's peek). With
-- `env` (decode()'s envelope), DelayedMessage's fields are written into it by
-- name instead (TEXT_FIELDS, VARINT_FIELDS; others are skipped) and fs and fn
-- are `env`: no table per wire type, none that grows.
local function message(s, from, to, spans, env)
  local fs, fn, md, pos, pairs_read = env, env, {}, from, 0
  if not env then fs, fn = {}, {} end
  -- Only spans need their ends: the fire path decodes without this table.
  local fe = spans and {} or nil
  while pos <= to do
    local key = byte(s, pos)
    if key < 128 then pos = pos + 1 else key, pos = varint(s, pos) end
    local wt = key % 8
    local n = (key - wt) / 8
    if wt == 2 then
      local len = byte(s, pos)
      if len < 128 then pos = pos + 1 else len, pos = varint(s, pos) end
      local e = pos + len - 1
      if e > to then error('truncated field') end
      if spans then
        fs[n], fe[n], fn[n] = pos, e, nil
      elseif n == 4 then
        local k, v = map_entry(s, pos, e)
        md[k] = v
        pairs_read = pairs_read + 1
      elseif not env then
        fs[n], fn[n] = sub(s, pos, e), nil
      elseif TEXT_FIELDS[n] then
        env[TEXT_FIELDS[n]] = sub(s, pos, e)
      elseif VARINT_FIELDS[n] then
        env[VARINT_FIELDS[n]] = 0
      end
      pos = e + 1
    elseif wt == 0 then
      local v
      v, pos = varint(s, pos)
      if not env then
        fn[n], fs[n] = v, nil
      elseif VARINT_FIELDS[n] then
        env[VARINT_FIELDS[n]] = v
      elseif TEXT_FIELDS[n] then
        env[TEXT_FIELDS[n]] = ''
      end
    else
      pos = skip(wt, s, pos)
    end
  end
  return fs, fn, md, pairs_read, fe
end

-- The envelope as a table: topic, entries = {{data, metadata table, content type}, ...},
-- size (payload bytes), raw (envelope bytes), pairs (metadata entries of all its
-- messages), pubsub (the component it was published through), bulk, id, due, sid, kind, schedule, expires, source, sttl,
-- target, attempt, published (acceptance ms), every (@every interval ms, 0 otherwise),
-- catchup (scheduleCatchup: 0 one, 1 all, 2 none), cwindow (its window ms, 0 = the default);
-- body and ct: the raw fields 2 and 3.
local function decode(s)
  local env = {
    topic = '', body = '', ct = '', id = '', due = 0, sid = '', kind = 0, schedule = '', expires = 0, source = '',
    sttl = 0, target = '', attempt = 0, bulk = 0, entries = {}, size = 0, raw = #s, pairs = 0, pubsub = '',
    published = 0, every = 0, catchup = 0, cwindow = 0,
  }
  local _, _, md, np = message(s, 1, #s, nil, env)
  env.pairs, env.bulk = np, env.bulk ~= 0
  if env.topic == '' then error('no topic') end
  local body = env.body
  if not env.bulk then
    env.entries[1] = {body, md, env.ct}
    env.size = #body
    return env
  end
  each_field(body, 1, #body, function(fno, b, e)
    if fno ~= 1 or not b then return end
    local efs, _, emd, enp = message(body, b, e)
    env.pairs = env.pairs + enp
    local event = efs[2] or ''
    env.entries[#env.entries + 1] = {event, emd, efs[3] or ''}
    env.size = env.size + #event
  end)
  return env
end
