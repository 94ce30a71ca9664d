-- Delete a claimed record so that a retry can run, fenced by its owner token.
-- KEYS[1]  record key
-- KEYS[2]  settle channel of the record (same hash tag, so the same cluster slot)
-- ARGV[1]  owner token
-- ARGV[2]  record format version
-- ARGV[3]  the publish command: PUBLISH (standalone) or SPUBLISH (Cluster)
-- Publishes on the channel only when the record was marked as waited for ('W').
-- Returns 1 when deleted, 0 when the caller no longer owns the key.
local key = KEYS[1]
local record = redis.pcall('GET', key)
if type(record) ~= 'string' or #record < 50 or string.sub(record, 1, 1) ~= ARGV[2]
    or string.sub(record, 35, 50) ~= ARGV[1] then
  return 0
end
local state = string.sub(record, 2, 2)
if state ~= 'P' and state ~= 'W' then
  return 0
end
redis.call('DEL', key)
if state == 'W' then
  redis.call(ARGV[3], KEYS[2], 'released')
end
return 1
