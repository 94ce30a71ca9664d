-- Claim an idempotency record, or report what already holds it. One key, one round trip.
-- KEYS[1]  record key: {prefix}:{hash}
-- ARGV[1]  request fingerprint (32 raw bytes)
-- ARGV[2]  owner token for a new claim (16 raw bytes)
-- ARGV[3]  lease in milliseconds
-- ARGV[4]  record format version (one byte)
-- ARGV[5]  '1' when the caller waits for an in-progress record to settle: the record is
--          marked 'W', and its settle publishes (see complete.lua, release.lua); '0' otherwise
-- ARGV[6]  how long the claim's record lives, in milliseconds: the lease and the recovery window
--          (how long an in-progress record outlives its lease), added up by the caller: a
--          number Lua adds is written back as text, which costs Redis more than the addition
-- ARGV[7]  the latest server time (ms since the Unix epoch) at which the claim may be applied;
--          '0' for none. A claim held up on the wire past it (its caller gave up) writes nothing
-- A record is one string (see src/store/redis/mod.rs):
--   version (1) | state (1) | fingerprint (32) | owner token (16) | lease deadline, or
--   version (1) | state (1) | fingerprint (32) | response
--   version (1) | 'X' | fingerprint (32) | owner token (16), the marker abandon.lua leaves
--   state: 'P' in progress, 'W' in progress with waiters, 'C' completed, 'X' abandoned
--   lease deadline: milliseconds since the Unix epoch by the server's clock, in decimal; an
--   in-progress record of exactly 50 bytes (written before deadlines) has none, and lives
--   exactly as long as its lease
-- Returns one of (a claim and a takeover answer a lone value: redis-rs reads an array's reply
-- at about twice the cost; a replay stays an array, since joining its time to live to the
-- record would copy the record in Lua, 15 µs more per call at 16 KiB):
--   0                   claimed: the caller owns the key for the lease
--   {1, record, ttl}    completed with the same fingerprint: the whole record, to replay, and
--                       its remaining time to live in milliseconds
--   {2}                 a different fingerprint holds the key: mismatch
--   {3, remaining_ms}   in progress under another owner
--   {4, reason}         the value was not written by this layer (or by another version)
--   5                   taken over: the same fingerprint's lease lapsed within its recovery
--                       window; the caller owns the key for the lease
--   {6}                 refused, nothing written: the claim arrived after its deadline, or
--                       the caller's own token abandoned it before it arrived
local key = KEYS[1]
-- No local functions, and one write at the end that every claim shares: this script runs on
-- every new key, and building closures on each run, like each `redis.call`, costs Redis time.
local record = redis.pcall('GET', key)
-- What a claim writes: its state, its answer, and the server's time if it was read already.
local state, answer, now = 'P', 0, nil
if record then
  if type(record) == 'table' then
    return {4, 'not a string'}
  end
  if string.sub(record, 1, 1) ~= ARGV[4] or #record < 34 then
    return {4, 'unknown version or truncated'}
  end
  state = string.sub(record, 2, 2)
  if state == 'X' and #record == 50 then
    -- An abandoned claim's marker: it refuses that claim, landing late; for any other claim
    -- the key is absent.
    if string.sub(record, 35, 50) == ARGV[2] then
      return {6}
    end
    state = 'P'
  else
    local deadline = nil
    if state == 'P' or state == 'W' then
      if #record > 50 then
        deadline = tonumber(string.sub(record, 51))
      end
      if #record < 50 or (#record > 50 and deadline == nil) then
        return {4, 'unknown state'}
      end
    elseif state ~= 'C' then
      return {4, 'unknown state'}
    end
    if string.sub(record, 3, 34) ~= ARGV[1] then
      return {2}
    end
    if state == 'C' then
      return {1, record, redis.call('PTTL', key)}
    end
    if deadline == nil then
      if state == 'P' and ARGV[5] == '1' then
        redis.call('SETRANGE', key, 1, 'W')
      end
      return {3, redis.call('PTTL', key)}
    end
    local time = redis.call('TIME')
    now = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)
    if now < deadline then
      if state == 'P' and ARGV[5] == '1' then
        redis.call('SETRANGE', key, 1, 'W')
      end
      return {3, deadline - now}
    end
    -- The lease lapsed: the caller takes over. A 'W' mark stays, so the settle still
    -- publishes to whoever waits.
    answer = 5
  end
end
if now == nil then
  local time = redis.call('TIME')
  now = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)
end
local not_after = tonumber(ARGV[7]) or 0
if not_after > 0 and now > not_after then
  return {6}
end
local lease = tonumber(ARGV[3])
redis.call('SET', key, ARGV[4] .. state .. ARGV[1] .. ARGV[2] .. string.format('%.0f', now + lease),
  'PX', ARGV[6])
return answer
