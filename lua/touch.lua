-- Renew the lease of a claimed record while its handler runs, fenced by its owner token.
-- KEYS[1]  record key
-- ARGV[1]  owner token
-- ARGV[2]  lease in milliseconds; 0 ends the lease now (the next claim takes over)
-- ARGV[3]  record format version
-- ARGV[4]  recovery window in milliseconds
-- Returns 1 when renewed, 0 when the caller no longer owns the key.
local key = KEYS[1]
local record = redis.pcall('GET', key)
if type(record) ~= 'string' or #record < 50 or string.sub(record, 1, 1) ~= ARGV[3]
    or string.sub(record, 35, 50) ~= ARGV[1] then
  return 0
end
local state = string.sub(record, 2, 2)
if state ~= 'P' and state ~= 'W' then
  return 0
end
local lease = tonumber(ARGV[2])
local time = redis.call('TIME')
local now = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)
redis.call('SET', key, string.sub(record, 1, 50) .. string.format('%.0f', now + lease),
  'PX', math.max(lease + tonumber(ARGV[4]), 1))
return 1
