-- LIBRARY history.lua: appends lifecycle records (format: delayed_middleware/history.py).
-- Expects the including script's local HISTORY (the history stream). The
-- including script sets HIST_MAXLEN (0 = history off) and
-- HIST_NOW before calling hist().
-- Every record has the same fields in the same order, so Redis stores the
-- field names once per stream node instead of once per record.
--
-- The by-id index (`history --id` without a scan): a record whose `id` is
-- not a stream id (a scheduleId, or an id a publisher named) carries in
-- `prev` the entry id of the previous record of the same id, and the hash
-- HIST_KEY .. '-ids' maps the id to its newest record's entry id. The
-- records of one id are so a chain, newest first, that ends where the
-- history was trimmed. The hash's field '' says where indexing began: '0-0'
-- when the history's first record was written by this code, else the first
-- record indexed or (HIST_SWEEP) the last record found unindexed; older
-- records predate the index and are found by a scan. The key is
-- derived, not passed: it shares the history's hash tag, so its slot, and
-- every script that writes history keeps its KEYS.
local HIST_MAXLEN, HIST_NOW = 0, '0'
local HIST_KEY = HISTORY
-- (nil where a test runs the libraries without keys)
local HIST_INDEX = HISTORY and HISTORY .. '-ids'
local KIND_NAMES = {[0] = 'oneshot', [1] = 'recurring', [2] = 'retry'}

local function hist_indexed(id)
  return id ~= '' and not string.find(id, '^%d+%-%d+$')
end

-- Whether the index's '' field exists, as far as this script call knows (nil:
-- not read yet). Once it does, the HSETNX below cannot change it and the XLEN
-- is skipped: the fire path writes one record per message. Nothing removes
-- the field (HIST_SWEEP keeps it).
local HIST_MARKED = nil

-- After an unindexed record: the history's very first record marks the whole
-- history as indexed (an XLEN, O(1)). Checked once per script call while the
-- field exists (the common case: the history began with this code).
local function hist_began(index)
  if HIST_MARKED == nil then HIST_MARKED = redis.call('HEXISTS', index, '') == 1 end
  if HIST_MARKED then return end
  if redis.call('XLEN', HIST_KEY) == 1 then
    redis.call('HSETNX', index, '', '0-0')
    HIST_MARKED = true
  end
end

-- The record `entry` of `id` just written: the index names it as the id's
-- newest (and, the id's first, where indexing began if nothing was); an
-- unindexed one may be the history's first. Returns `entry`.
local function hist_linked(index, id, indexed, prev, entry)
  if indexed then
    redis.call('HSET', index, id, entry)
    if prev == '' and not HIST_MARKED then
      redis.call('HSETNX', index, '', entry)
      HIST_MARKED = true
    end
  else
    hist_began(index)
  end
  return entry
end

-- XADD of one record given as a flat field/value list without `prev`
-- (the history's other writers: the subscriber retrier and the forwarder
-- through hist_append.lua, UNCANCEL), linked into the by-id index after
-- `prev` (nil: the id's newest record). Returns the entry id.
local function hist_fields(id, fields, prev)
  local index = HIST_INDEX
  local indexed = hist_indexed(id)
  if prev == nil then prev = indexed and redis.call('HGET', index, id) or '' end
  local args = {HIST_KEY, 'MAXLEN', '~', HIST_MAXLEN, '*'}
  for i = 1, #fields do args[#args + 1] = fields[i] end
  args[#args + 1] = 'prev'
  args[#args + 1] = prev
  return hist_linked(index, id, indexed, prev, redis.call('XADD', unpack(args)))
end

-- Numbers as the record's text, as Redis would print them ('%.17g': glibc's
-- float printer, most of a record's argument cost): integral ones with '%d',
-- the same digits, each printed once per call (a batch repeats its lateness,
-- sizes, attempt and maxlen); anything else is handed to Redis as it is.
local HIST_TEXTS = {}
local function hist_text(v)
  -- (NaN cannot be a table key: it goes to Redis as it is.)
  if type(v) ~= 'number' or v ~= v then return v end
  local t = HIST_TEXTS[v]
  if t == nil then
    t = v
    if v == math.floor(v) and v > -1e15 and v < 1e15 then t = string.format('%d', v) end
    HIST_TEXTS[v] = t
  end
  return t
end

-- Set by a script that writes a record per message (FIRE, RELEASE): its
-- records are appended untrimmed and hist_trim() trims the history at its end,
-- as the records' own MAXLEN ~ would have (approximate trimming drops whole
-- nodes while the rest still holds HIST_MAXLEN: the same nodes). HIST_UNTRIMMED
-- counts those records: one trim evicts at most Redis's LIMIT (by default 100
-- nodes' worth), and each record's own trim could evict that much.
local HIST_TRIM_AT_END = false
local HIST_UNTRIMMED = 0

-- Returns the record's entry id (nil when the history is off). The fire
-- path's writer: one XADD with literal arguments, and for an indexed id an
-- HGET and an HSET besides. `occ` (optional): the nominal time (epoch ms) of
-- the occurrence a `fired` record delivered; written as the field `occ` only
-- when it differs from `due` (jittered or paced), so the common record keeps
-- the stream node's shared field names (history.py: absent = `due`).
local function hist(event, id, sid, topic, kind, due, late, size, attempt, reason, schedule, occ)
  if HIST_MAXLEN == 0 then return nil end
  local indexed = hist_indexed(id)
  local index = HIST_INDEX
  local prev = indexed and redis.call('HGET', index, id) or ''
  local kn = KIND_NAMES[kind] or 'oneshot'
  due, late, size, attempt = hist_text(due), hist_text(late), hist_text(size), hist_text(attempt)
  local entry
  if occ ~= nil and occ ~= due and tostring(occ) ~= tostring(due) then
    entry = redis.call('XADD', HIST_KEY, 'MAXLEN', '~', hist_text(HIST_MAXLEN), '*',
      'event', event, 'at', HIST_NOW, 'id', id, 'sid', sid, 'topic', topic,
      'kind', kn, 'due', due, 'late', late, 'size', size,
      'attempt', attempt, 'reason', reason, 'schedule', schedule, 'occ', occ, 'prev', prev)
  elseif HIST_TRIM_AT_END then
    entry = redis.call('XADD', HIST_KEY, '*',
      'event', event, 'at', HIST_NOW, 'id', id, 'sid', sid, 'topic', topic,
      'kind', kn, 'due', due, 'late', late, 'size', size,
      'attempt', attempt, 'reason', reason, 'schedule', schedule, 'prev', prev)
    HIST_UNTRIMMED = HIST_UNTRIMMED + 1
  else
    entry = redis.call('XADD', HIST_KEY, 'MAXLEN', '~', hist_text(HIST_MAXLEN), '*',
      'event', event, 'at', HIST_NOW, 'id', id, 'sid', sid, 'topic', topic,
      'kind', kn, 'due', due, 'late', late, 'size', size,
      'attempt', attempt, 'reason', reason, 'schedule', schedule, 'prev', prev)
  end
  return hist_linked(index, id, indexed, prev, entry)
end

-- The trims hist() left to the end of a HIST_TRIM_AT_END script: one XTRIM, and
-- another while the last evicted something, up to one per untrimmed record (a
-- batch that outgrows one trim's LIMIT, or a historyMaxLen lowered while full,
-- is trimmed as far as its records' own trims would have reached). Nothing if no
-- record was left untrimmed. In a steady state: two XTRIMs, the second evicts nothing.
local function hist_trim()
  local len = hist_text(HIST_MAXLEN)
  for _ = 1, HIST_UNTRIMMED do
    if redis.call('XTRIM', HIST_KEY, 'MAXLEN', '~', len) == 0 then break end
  end
  HIST_UNTRIMMED = 0
end

-- A recurring schedule fired its last occurrence (its scheduleEnd or scheduleLimit
-- reached, or year 9999) and is removed: the record `stats` counts as completed.
local function completed(key, env, due, attempt)
  return hist('completed', key, env.sid, env.topic, env.kind, due, '', env.size, attempt, 'NoNextFire', env.schedule)
end
