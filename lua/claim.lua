-- Claim an idempotency record, or report what already holds it. One key, one round trip.
-- KEYS[1]  record key: {prefix}:{hash}
-- ARGV[1]  request fingerprint (32 raw bytes)
-- ARGV[2]  owner token for a new claim (16 raw bytes)
-- ARGV[3]  lease in milliseconds
-- ARGV[4]  record format version (one byte)
-- ARGV[5]  '1' when the caller waits for an in-progress record to settle: the record is
--          marked 'W', and its settle publishes (see complete.lua, release.lua); '0' otherwise
-- A record is one string (see src/store/redis/mod.rs):
--   version (1) | state (1) | fingerprint (32) | owner token (16) or response
--   state: 'P' in progress, 'W' in progress with waiters, 'C' completed
-- Returns one of:
--   {0}                 claimed: the caller owns the key for the lease
--   {1, record}         completed with the same fingerprint: the whole record, to replay
--   {2}                 a different fingerprint holds the key: mismatch
--   {3, remaining_ms}   in progress under another owner
--   {4, reason}         the value was not written by this layer (or by another version)
local key = KEYS[1]
local record = redis.pcall('GET', key)
if not record then
  redis.call('SET', key, ARGV[4] .. 'P' .. ARGV[1] .. ARGV[2], 'PX', ARGV[3])
  return {0}
end
if type(record) == 'table' then
  return {4, 'not a string'}
end
if string.sub(record, 1, 1) ~= ARGV[4] or #record < 34 then
  return {4, 'unknown version or truncated'}
end
local state = string.sub(record, 2, 2)
if state ~= 'C' and not ((state == 'P' or state == 'W') and #record == 50) then
  return {4, 'unknown state'}
end
if string.sub(record, 3, 34) ~= ARGV[1] then
  return {2}
end
if state == 'C' then
  return {1, record}
end
if state == 'P' and ARGV[5] == '1' then
  redis.call('SETRANGE', key, 1, 'W')
end
return {3, redis.call('PTTL', key)}
