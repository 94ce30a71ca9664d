-- Store the response of a claimed request, fenced by its owner token.
-- KEYS[1]  record key
-- KEYS[2]  settle channel of the record (same hash tag, so the same cluster slot)
-- ARGV[1]  owner token
-- ARGV[2]  retention in milliseconds
-- ARGV[3]  the publish command: PUBLISH (standalone) or SPUBLISH (Cluster)
-- ARGV[4]  the completed record, written whole by the caller: version (1) | 'C' |
--          fingerprint (32) | encoded response. Not joined here: Lua would copy the response
--          into a new string on every call, which costs Redis more than the rest of the script
--          at 16 KiB.
-- Writes when the caller still owns the key, or when the key is absent (the lease lapsed and
-- nobody took over; the marker of an abandoned claim, see abandon.lua, counts as absent).
-- Publishes on the channel only when the record was marked as waited for ('W'), so a request
-- nobody waits for costs no publish.
-- Returns 1 when written; 2 when the record already holds this very response (an earlier
-- attempt of this complete landed, though its answer was lost); 0 when another owner, another
-- stored response, or a value this layer did not write holds it.
local key = KEYS[1]
local completed = ARGV[4]
local record = redis.pcall('GET', key)
local waited = false
if type(record) == 'string' and #record == 50 and string.sub(record, 2, 2) == 'X' then
  record = false
end
if record then
  if record == completed then
    return 2
  end
  if type(record) == 'table' or #record < 50
      or string.sub(record, 1, 1) ~= string.sub(completed, 1, 1)
      or string.sub(record, 35, 50) ~= ARGV[1] then
    return 0
  end
  local state = string.sub(record, 2, 2)
  if state ~= 'P' and state ~= 'W' then
    return 0
  end
  waited = state == 'W'
end
redis.call('SET', key, completed, 'PX', ARGV[2])
if waited then
  redis.call(ARGV[3], KEYS[2], 'completed')
end
return 1
