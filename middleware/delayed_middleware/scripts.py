"""The Lua scripts of the delay engine: every state change of a delayed message.

Each script runs atomically inside Redis, which is what makes firing exactly
once: a message leaves the due index (ZREM returning 1) in the same atomic step
that appends it to its target topic, so a second replica, a retry after a
crash, or a replay of the same batch finds it gone and writes nothing.

Key layout: see delayed_middleware.keys.EngineKeys.
"""

from __future__ import annotations

from delayed_middleware.entry import CONTENT_TYPE, DATA, METADATA

# SCHEDULE: store envelopes durably and index them by due time.
# KEYS[1] stream (the delayed topic), KEYS[2] due zset, KEYS[3] ids hash
# ARGV[1] wake channel
# ARGV[2] n, then n triples: envelope bytes, due ms, scheduleId ('' for none)
# Returns the new envelope stream ids, in order.
# A scheduleId already pending is replaced: its old envelope leaves the index
# and the stream, so it can never fire. The wake channel is told when a new
# envelope became the earliest, so sleeping replicas shorten their sleep.
SCHEDULE = f"""
local n = tonumber(ARGV[2])
local ids = {{}}
local earliest = nil
for i = 0, n - 1 do
  local env = ARGV[3 + i * 3]
  local due = ARGV[4 + i * 3]
  local sid = ARGV[5 + i * 3]
  local id = redis.call('XADD', KEYS[1], '*', '{DATA}', env, '{METADATA}', '{{}}')
  redis.call('ZADD', KEYS[2], due, id)
  if sid ~= '' then
    local old = redis.call('HGET', KEYS[3], sid)
    if old then
      redis.call('ZREM', KEYS[2], old)
      redis.call('XDEL', KEYS[1], old)
    end
    redis.call('HSET', KEYS[3], sid, id)
  end
  ids[#ids + 1] = id
  if earliest == nil or tonumber(due) < earliest then earliest = tonumber(due) end
end
local head = redis.call('ZRANGE', KEYS[2], 0, 0, 'WITHSCORES')
if earliest ~= nil and head[2] ~= nil and tonumber(head[2]) >= earliest then
  redis.call('PUBLISH', ARGV[1], tostring(earliest))
end
return ids
"""

# PEEK: read, without changing anything, what is due.
# KEYS[1] due zset, KEYS[2] stream
# ARGV[1] now ms, ARGV[2] limit
# Returns {head, id1, data1, id2, data2, ...}: head is the earliest due time
# left after this batch ('' when none); data is false for an id whose envelope
# is missing from the stream (deleted by hand), so the caller can drop it.
PEEK = f"""
local due = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1], 'LIMIT', 0, tonumber(ARGV[2]))
local out = {{''}}
for _, id in ipairs(due) do
  local e = redis.call('XRANGE', KEYS[2], id, id)
  local data = false
  if e[1] then
    local f = e[1][2]
    for j = 1, #f, 2 do
      if f[j] == '{DATA}' then data = f[j + 1] end
    end
  end
  out[#out + 1] = id
  out[#out + 1] = data
end
local nxt = redis.call('ZRANGE', KEYS[1], #due, #due, 'WITHSCORES')
if nxt[2] then out[1] = nxt[2] end
return out
"""

# FIRE: move due envelopes to their target topics, exactly once.
# KEYS[1] stream, KEYS[2] due zset, KEYS[3] ids hash, KEYS[4..] target streams
# ARGV[1] trim mode ('' | 'MAXLEN' | 'MINID'), ARGV[2] trim threshold
# ARGV[3] number of envelopes, then for each envelope:
#   envelope stream id, scheduleId ('' for none), number of entries m, then m times:
#   target key index (into KEYS), data, metadata JSON, content type ('' for none)
# Returns the number of envelopes fired by this call (others were already gone).
FIRE = f"""
local pos = 4
local fired = 0
for _ = 1, tonumber(ARGV[3]) do
  local id = ARGV[pos]
  local sid = ARGV[pos + 1]
  local m = tonumber(ARGV[pos + 2])
  pos = pos + 3
  local won = redis.call('ZREM', KEYS[2], id) == 1
  for _ = 1, m do
    if won then
      local args = {{KEYS[tonumber(ARGV[pos])]}}
      if ARGV[1] ~= '' then
        args[#args + 1] = ARGV[1]
        args[#args + 1] = '~'
        args[#args + 1] = ARGV[2]
      end
      args[#args + 1] = '*'
      args[#args + 1] = '{DATA}'
      args[#args + 1] = ARGV[pos + 1]
      args[#args + 1] = '{METADATA}'
      args[#args + 1] = ARGV[pos + 2]
      if ARGV[pos + 3] ~= '' then
        args[#args + 1] = '{CONTENT_TYPE}'
        args[#args + 1] = ARGV[pos + 3]
      end
      redis.call('XADD', unpack(args))
    end
    pos = pos + 4
  end
  if won then
    redis.call('XDEL', KEYS[1], id)
    if sid ~= '' and redis.call('HGET', KEYS[3], sid) == id then
      redis.call('HDEL', KEYS[3], sid)
    end
    fired = fired + 1
  end
end
return fired
"""

# DROP: remove index entries whose envelope vanished from the stream.
# KEYS[1] due zset; ARGV: the stream ids. Returns how many were removed.
DROP = """
return redis.call('ZREM', KEYS[1], unpack(ARGV))
"""

# CANCEL: withdraw a pending envelope by scheduleId; nothing is delivered.
# KEYS[1] stream, KEYS[2] due zset, KEYS[3] ids hash; ARGV[1] scheduleId
# Returns 1 when something pending was canceled, 0 when nothing was pending.
CANCEL = """
local id = redis.call('HGET', KEYS[3], ARGV[1])
if not id then return 0 end
redis.call('HDEL', KEYS[3], ARGV[1])
local removed = redis.call('ZREM', KEYS[2], id)
redis.call('XDEL', KEYS[1], id)
return removed
"""
