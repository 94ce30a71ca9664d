-- Renew the lease of a claimed record while its handler runs, fenced by its owner token.
-- KEYS[1]  record key
-- ARGV[1]  owner token
-- ARGV[2]  lease in milliseconds
-- Returns 1 when renewed, 0 when the caller no longer owns the key.
local key = KEYS[1]
if redis.call('TYPE', key)['ok'] == 'hash' and redis.call('HGET', key, 'o') == ARGV[1] then
  redis.call('PEXPIRE', key, ARGV[2])
  return 1
end
return 0
