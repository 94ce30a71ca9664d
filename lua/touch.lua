-- Renew the lease of a claimed record while its handler runs, fenced by its owner token.
-- KEYS[1]  record key
-- ARGV[1]  owner token
-- ARGV[2]  lease in milliseconds
-- ARGV[3]  record format version
-- Returns 1 when renewed, 0 when the caller no longer owns the key.
local key = KEYS[1]
local record = redis.pcall('GET', key)
if type(record) == 'string' and #record == 50 and string.sub(record, 1, 2) == ARGV[3] .. 'P'
    and string.sub(record, 35) == ARGV[1] then
  redis.call('PEXPIRE', key, ARGV[2])
  return 1
end
return 0
