-- LIBRARY common.lua: envelope bookkeeping shared by the engine's scripts.
-- Needs index.lua, decode.lua and history.lua included before it.
-- KEYS: 1 delayed stream, 3 ids hash, 7 parked hash, 9 refill zset.

-- The envelope stored at stream id `id`, decoded, or nil (gone or undecodable) and why.
local function read_envelope(id)
  local e = redis.call('XRANGE', KEYS[1], id, id)[1]
  if not e then return nil, 'gone' end
  local f = e[2]
  for j = 1, #f, 2 do
    if f[j] == 'data' then
      local ok, env = pcall(decode, f[j + 1])
      if ok then return env, '' end
      return nil, 'undecodable: ' .. tostring(env)
    end
  end
  return nil, 'undecodable: no data field'
end

-- Withdraws everything of the envelope an ids-hash ref points to (index entry,
-- stream entry, refill and parked marks); the ids entry itself is the caller's.
local function drop_ref(key, ref)
  local sid, due, _, _, flag = parse_ref(ref)
  if flag ~= 'u' then remove(sid, due) end
  redis.call('XDEL', KEYS[1], sid)
  redis.call('ZREM', KEYS[9], key)
  redis.call('HDEL', KEYS[7], sid)
  return sid, due
end
