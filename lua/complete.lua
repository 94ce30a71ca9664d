-- Store the response of a claimed request, fenced by its owner token.
-- KEYS[1]  record key
-- ARGV[1]  owner token
-- ARGV[2]  request fingerprint
-- ARGV[3]  encoded response
-- ARGV[4]  retention in milliseconds
-- ARGV[5]  record format version
-- Writes when the caller still owns the key, or when the key is absent (the lease lapsed and
-- nobody took over). Returns 1 when written, 0 when another owner or a stored response holds it.
local key = KEYS[1]
local kind = redis.call('TYPE', key)['ok']
if kind ~= 'none' then
  if kind ~= 'hash' or redis.call('HGET', key, 'o') ~= ARGV[1] then
    return 0
  end
  redis.call('HDEL', key, 'o')
end
redis.call('HSET', key, 'v', ARGV[5], 'f', ARGV[2], 'r', ARGV[3])
redis.call('PEXPIRE', key, ARGV[4])
return 1
