-- LIBRARY history.lua: appends lifecycle records (format: delayed_middleware/history.py).
-- Expects KEYS[6] = history stream. The including script sets HIST_MAXLEN
-- (0 = history off) and HIST_NOW before calling hist().
-- Every record has the same fields in the same order, so Redis stores the
-- field names once per stream node instead of once per record.
local HIST_MAXLEN, HIST_NOW = 0, '0'
local KIND_NAMES = {[0] = 'oneshot', [1] = 'recurring', [2] = 'retry'}

-- Returns the record's entry id (nil when the history is off).
local function hist(event, id, sid, topic, kind, due, late, size, attempt, reason, schedule)
  if HIST_MAXLEN == 0 then return nil end
  return redis.call('XADD', KEYS[6], 'MAXLEN', '~', HIST_MAXLEN, '*',
    'event', event, 'at', HIST_NOW, 'id', id, 'sid', sid, 'topic', topic,
    'kind', KIND_NAMES[kind] or 'oneshot', 'due', due, 'late', late, 'size', size,
    'attempt', attempt, 'reason', reason, 'schedule', schedule)
end

-- A recurring schedule fired its last occurrence (its scheduleEnd or scheduleLimit
-- reached, or year 9999) and is removed: the record `stats` counts as completed.
local function completed(key, env, due, attempt)
  return hist('completed', key, env.sid, env.topic, env.kind, due, '', env.size, attempt, 'NoNextFire', env.schedule)
end
