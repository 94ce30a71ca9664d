-- Delete a claimed record so that a retry can run, fenced by its owner token.
-- KEYS[1]  record key
-- ARGV[1]  owner token
-- Returns 1 when deleted, 0 when the caller no longer owns the key.
local key = KEYS[1]
if redis.call('TYPE', key)['ok'] == 'hash' and redis.call('HGET', key, 'o') == ARGV[1] then
  redis.call('DEL', key)
  return 1
end
return 0
