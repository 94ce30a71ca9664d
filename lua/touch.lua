-- Renew the lease of a claimed record while its handler runs, fenced by its owner token.
-- KEYS[1]  record key
-- ARGV[1]  owner token
-- ARGV[2]  lease in milliseconds
-- ARGV[3]  record format version
-- Returns 1 when renewed, 0 when the caller no longer owns the key.
local key = KEYS[1]
local record = redis.pcall('GET', key)
if type(record) ~= 'string' or #record ~= 50 or string.sub(record, 1, 1) ~= ARGV[3]
    or string.sub(record, 35) ~= ARGV[1] then
  return 0
end
local state = string.sub(record, 2, 2)
if state ~= 'P' and state ~= 'W' then
  return 0
end
redis.call('PEXPIRE', key, ARGV[2])
return 1
