-- APPEND: phase 2 of the two-phase fire, in the TARGET's slot: one call per
-- target key (a topic, or a shard's outbox), for the claimed envelopes bound there.
-- KEYS: 1 the target stream, 2..n+1 the fire marker of each envelope
--       ({<target's tag>}:<shard stream>}fired:<envelope id>:<due ms>, see keys.fire_marker_prefix)
-- ARGV: 1 marker TTL ms, 2 trim mode ('' | 'MAXLEN' | 'MINID' | 'MINAGE': MINID at
--       this node's TIME - ARGV[3]), 3 trim threshold,
--       4 n envelopes; then per envelope: trim (1: apply ARGV[2..3]; 0: the message
--       was published through another component, whose trim is not ours, as in
--       FIRE), k entries, then per entry: m field/value pairs, then the 2m strings
--       (data, metadata, contentType, expiresAt, ...)
-- Returns one status per envelope: 'ok' (appended now), 'dup' (its marker was
-- already set: appended before, by this or another replica), or the error that
-- kept the first entry out (the caller parks the envelope).
--
-- Why exactly once across crashes: the marker is set with NX in the same
-- atomic step as the XADDs, so an envelope's entries are appended if and only
-- if its marker was absent; a re-run after a crash or a lease takeover finds
-- the marker and appends nothing. The marker lives longer than any claim can
-- stay in flight (engine.EngineConfig.fire_marker_ttl_ms).
local TARGET = KEYS[1]
-- The fire marker of envelope i (KEYS[2..n+1]).
local function marker(i) return KEYS[i + 1] end
local TTL_MS, TRIM_MODE, TRIM_AT, N_ENVELOPES = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local ttl, trim_mode, trim_at = TTL_MS, TRIM_MODE, TRIM_AT
-- MINAGE: streamTTL with the threshold on this node's TIME, the clock that
-- made the target topic's ids (not the firing replica's).
if trim_mode == 'MINAGE' then
  local t = redis.call('TIME')
  local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  trim_mode, trim_at = 'MINID', string.format('%.0f-1', now - tonumber(trim_at))
end
local target = TARGET
local t = redis.call('TYPE', target).ok
local bad = nil
if t ~= 'stream' and t ~= 'none' then bad = 'WRONGTYPE: the key is a ' .. t .. ', not a stream' end
local out, pos = {}, 5
for i = 1, tonumber(N_ENVELOPES) do
  local trim = ARGV[pos] == '1'
  local k = tonumber(ARGV[pos + 1])
  pos = pos + 2
  local entries = {}
  for _ = 1, k do
    local m = tonumber(ARGV[pos])
    entries[#entries + 1] = {pos + 1, m}
    pos = pos + 1 + 2 * m
  end
  if bad then
    out[i] = bad
  elseif not redis.call('SET', marker(i), '1', 'NX', 'PX', ttl) then
    out[i] = 'dup'
  else
    local done, failed = 0, nil
    for _, e in ipairs(entries) do
      local args = {target}
      if trim and trim_mode ~= '' then args[2], args[3], args[4] = trim_mode, '~', trim_at end
      args[#args + 1] = '*'
      for j = e[1], e[1] + 2 * e[2] - 1 do args[#args + 1] = ARGV[j] end
      local ok, err = pcall(redis.call, 'XADD', unpack(args))
      if not ok then
        failed = tostring(err)
        break
      end
      done = done + 1
    end
    if failed and done == 0 then
      -- Nothing of it went out: no marker, so the envelope parks (RELEASE).
      redis.call('DEL', marker(i))
      out[i] = failed
    else
      out[i] = 'ok'
    end
  end
end
return out
