-- LIBRARY target_append.lua: appending an occurrence's messages to its target,
-- shared by FIRE (fire.lua) and TIMECONTROL's single-node trigger (timecontrol.lua),
-- so an extra occurrence goes out exactly as a fire's does. Needs batch.lua
-- included before it (B, reserved, stamped). Expects the including script's
-- locals now, trim_mode, trim_at (MINAGE already turned into MINID) and own_pubsub.

-- Per topic, bad_target's verdict (false: fine). It cannot change within the
-- call: the script's own XADDs only turn a missing key into a stream.
local verdicts = {}

-- Why `topic` cannot take our XADD, or nil (CLAIM leaves the type check to APPEND).
local function bad_target(topic)
  local v = verdicts[topic]
  if v == nil then
    v = reserved(topic)
    if not v then
      local t = redis.call('TYPE', topic).ok
      if t ~= 'stream' and t ~= 'none' then v = 'WRONGTYPE: the key is a ' .. t .. ', not a stream' end
    end
    verdicts[topic] = v or false
  end
  return v or nil
end

-- The message a schedule with scheduleSource produces: the source topic's latest entry.
local function sampled(source)
  if bad_target(source) then return {} end
  local last = redis.call('XREVRANGE', source, '+', '-', 'COUNT', 1)[1]
  if not last then return {} end
  local data, md, ct = '', {}, ''
  local f = last[2]
  for j = 1, #f, 2 do
    if f[j] == 'data' then data = f[j + 1]
    elseif f[j] == 'contentType' then ct = f[j + 1]
    elseif f[j] == 'metadata' then
      -- Anyone writes the source: keep its metadata only if it encodes again
      -- (cjson decodes 1e400 as inf, then refuses to encode it), else drop it
      -- as a reader of a malformed entry does; the data still goes out.
      local ok, t = pcall(cjson.decode, f[j + 1])
      if ok and type(t) == 'table' and pcall(cjson.encode, t) then md = t end
    end
  end
  return {{data, md, ct}}
end

-- One entry's XADD arguments in full (trim, content type, expiry, outbox fields).
local function xadd_args(env, key, target, trimmed, entry, json, expires)
  local args = {target}
  if trimmed then
    args[2], args[3], args[4] = trim_mode, '~', trim_at
  end
  args[#args + 1] = '*'
  args[#args + 1] = 'data'
  args[#args + 1] = entry[1]
  args[#args + 1] = 'metadata'
  args[#args + 1] = json
  if entry[3] ~= '' then
    args[#args + 1] = 'contentType'
    args[#args + 1] = entry[3]
  end
  if expires > 0 then
    args[#args + 1] = 'expiresAt'
    args[#args + 1] = tostring(expires)
  end
  if env.target ~= '' then
    args[#args + 1] = 'pubsub'
    args[#args + 1] = env.target
    args[#args + 1] = 'topic'
    args[#args + 1] = env.topic
    args[#args + 1] = 'id'
    args[#args + 1] = key
    if env.bulk then
      args[#args + 1] = 'bulk'
      args[#args + 1] = key
    end
  end
  return args
end

-- Appends one envelope's messages to `target`; returns how many, and why it stopped early (or nil).
local function append(env, key, iso, occ, target)
  local entries = env.entries
  if env.source ~= '' then
    entries = sampled(env.source)
    -- The sampled message is anyone's size: it counts like the envelope's own.
    local got = entries[1] and #entries[1][1] or 0
    B.bytes = B.bytes + got
    B.unchecked = B.unchecked + math.floor(got / 65536)
  end
  local expires = env.expires
  if env.sttl > 0 then expires = now + env.sttl end
  local done = 0
  -- Trimmed (the envelope's own topic, under maxLenApprox/streamTTL), or plain.
  local trimmed = env.target == '' and trim_mode ~= '' and (own_pubsub == '' or env.pubsub == own_pubsub)
  for _, entry in ipairs(entries) do
    -- Guarded like the XADD: nothing may raise after the first write.
    local json, why = stamped(entry[2], key, iso, occ)
    if not json then return done, why end
    local ok, err
    if not trimmed and entry[3] == '' and expires <= 0 and env.target == '' then
      -- The common entry (data and metadata only): no argument table to build and unpack.
      ok, err = pcall(redis.call, 'XADD', target, '*', 'data', entry[1], 'metadata', json)
    else
      ok, err = pcall(redis.call, 'XADD', unpack(xadd_args(env, key, target, trimmed, entry, json, expires)))
    end
    if not ok then return done, tostring(err) end
    done = done + 1
  end
  return done, nil
end
