-- Claim an idempotency record, or report what already holds it. One key, one round trip.
-- KEYS[1]  record key: {prefix}:{hash}
-- ARGV[1]  request fingerprint (32 raw bytes)
-- ARGV[2]  owner token for a new claim
-- ARGV[3]  lease in milliseconds
-- ARGV[4]  record format version
-- Returns one of:
--   {0}                 claimed: the caller owns the key for the lease
--   {1, response}       completed with the same fingerprint: replay the stored response
--   {2}                 a different fingerprint holds the key: mismatch
--   {3, remaining_ms}   in progress under another owner
--   {4, reason}         the value was not written by this layer (or by another version)
local key = KEYS[1]
local kind = redis.call('TYPE', key)['ok']
if kind == 'none' then
  redis.call('HSET', key, 'v', ARGV[4], 'f', ARGV[1], 'o', ARGV[2])
  redis.call('PEXPIRE', key, ARGV[3])
  return {0}
end
if kind ~= 'hash' then
  return {4, 'type ' .. kind}
end
local rec = redis.call('HMGET', key, 'v', 'f', 'o', 'r')
if rec[1] ~= ARGV[4] then
  return {4, 'version'}
end
if not rec[2] then
  return {4, 'fingerprint missing'}
end
if rec[2] ~= ARGV[1] then
  return {2}
end
if rec[4] then
  return {1, rec[4]}
end
if rec[3] then
  return {3, redis.call('PTTL', key)}
end
return {4, 'neither owner nor response'}
